"""Control plane end to end: the admin API, egressctl, dynamic runs, the encrypted store.

Every run here is dynamic (config `runs: []`): created through POST /v1/runs or egressctl.
Secret values never appear in test output: see cp_helpers.expect / fp.
"""
from __future__ import annotations

import base64
import http.client
import json
import os
import secrets as pysecrets
import shlex
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

import helpers
from cp_helpers import (SEEN, GitServer, admin_token, api, api_ok, bearer_pin, contains_any,
                        create_run, ctl, ctl_ok, cp_mutate, egressctl_bin, expect, get_via,
                        kms_stub, make_bare_repo, make_leaf, master_key_file, put_secret,
                        refused_or_closed, rotate_secret, seen_auth, state_dir)


def sval(tag: str) -> str:
    return helpers.secret(f"cpv-{tag}-" + pysecrets.token_hex(16))


@pytest.fixture(scope="module")
def cp(factory, world):
    """One egressd with the admin API, no static runs."""
    return factory.start(mutate=cp_mutate(world))


@pytest.fixture(scope="module")
def api_secret(cp):
    """A secret in org=acme used by several tests."""
    v = sval("api")
    put_secret(cp, "api_tok", v, org="acme")
    return v


def api_host(w) -> str:
    return f"api.test:{w.U}"


# ---------------------------------------------------------------------------------------------
# API auth and Host pinning


@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", "Basic Zm9vOmJhcg==", "Bearer ",
                                  "Bearer {tok}x", "Bearer x{tok}", "Token {tok}"])
def test_api_requires_the_admin_token(cp, auth):
    import http.client
    tok = admin_token(cp)
    for method, path, body in [("GET", "/v1/secrets", None),
                               ("POST", "/v1/secrets",
                                {"name": "nope", "scope": {"org": "acme"}, "value": "x"}),
                               ("POST", "/v1/runs", {"scope": {"org": "acme"}}),
                               ("DELETE", "/v1/secrets/nope", None),
                               ("POST", "/v1/keys/rotate", None)]:
        headers = {"Host": f"127.0.0.1:{cp.admin_port}"}
        if auth is not None:
            headers["Authorization"] = auth.format(tok=tok)
        conn = http.client.HTTPConnection("127.0.0.1", cp.admin_port, timeout=10)
        try:
            conn.request(method, path, body=json.dumps(body).encode() if body else None,
                         headers=headers)
            resp = conn.getresponse()
            status, data = resp.status, resp.read()
            www = resp.getheader("WWW-Authenticate") or ""
        finally:
            conn.close()
        SEEN.append((f"{method} {path}", data))
        assert status == 401, (method, path, status)
        j = json.loads(data)
        assert j["error"] == "unauthorized" and j["detail"], j
        assert www.startswith("Bearer")
    # Nothing was created by the refused requests.
    names = [s["name"] for s in api_ok(cp, "GET", "/v1/secrets")["secrets"]]
    assert "nope" not in names
    assert not [r for r in api_ok(cp, "GET", "/v1/secrets")["secrets"] if r["name"] == "nope"]


def test_an_api_call_without_the_token_is_answered_before_its_body(cp):
    """The token is checked on the request head: a call without it is answered 401 at once,
    its body never read (egressd had waited for up to admin.max_body_bytes of it, for
    admin.read_timeout, on every such connection)."""
    s = socket.create_connection(("127.0.0.1", cp.admin_port), timeout=2)
    try:
        s.sendall(f"POST /v1/secrets HTTP/1.1\r\nHost: 127.0.0.1:{cp.admin_port}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n".encode())
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(4096)  # times out (2 s) if egressd waits for the body
            if not chunk:
                break
            got += chunk
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 401"), got[:200]
    assert b"WWW-Authenticate: Bearer" in got, got[:400]


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_bearer_scheme_is_case_insensitive(cp, scheme):
    """RFC 9110 11.1: an authentication scheme's name is case-insensitive."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", cp.admin_port, timeout=10)
    try:
        conn.request("GET", "/v1/secrets", headers={
            "Host": f"127.0.0.1:{cp.admin_port}",
            "Authorization": f"{scheme} {admin_token(cp)}"})
        resp = conn.getresponse()
        status, data = resp.status, resp.read()
    finally:
        conn.close()
    SEEN.append(("GET /v1/secrets", data))
    assert status == 200, status


def test_health_endpoints_need_no_token(cp):
    assert api(cp, "GET", "/healthz", token=None).status == 200
    assert api(cp, "GET", "/readyz", token=None).status == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1:1",
                                  "localhost:{other}", "attacker.test:{port}", "10.0.0.1:{port}",
                                  "127.0.0.1.nip.io:{port}"])
def test_foreign_host_header_is_refused_before_routing(cp, host):
    h = host.format(port=cp.admin_port, other=cp.admin_port + 1)
    for token in (admin_token(cp), None):  # 403 even with the right token, and before auth
        r = api(cp, "GET", "/v1/secrets", host=h, token=token)
        assert r.status == 403, (h, r.status)
        assert r.json["error"] == "forbidden_host"


@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "localhost",
                                  "[::1]:{port}", "127.0.0.1"])
def test_loopback_host_header_is_accepted(cp, host):
    r = api(cp, "GET", "/v1/secrets", host=host.format(port=cp.admin_port))
    assert r.status == 200, r.status


def _dual_stack_loopback() -> bool:
    """[::] takes IPv4 connections too (net.ipv6.bindv6only 0) and ::1 is configured."""
    try:
        with open("/proc/sys/net/ipv6/bindv6only") as f:
            if f.read().strip() != "0":
                return False
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _dual_stack_loopback(), reason="needs a dual-stack [::] and ::1")
def test_host_is_pinned_on_a_dual_stack_admin_listener(factory, world):
    """listen.admin [::]:P sees a connection to 127.0.0.1 from ::ffff:127.0.0.1: it is loopback
    all the same, and its Host is pinned as on [::1] (it was not: any Host got 200)."""
    import http.client

    def use_dual_stack(cfg):
        cfg["listen"]["admin"] = "[::]:" + cfg["listen"]["admin"].rsplit(":", 1)[1]

    e = factory.start(mutate=cp_mutate(world, extra=use_dual_stack))
    port, tok = e.admin_port, admin_token(e)

    def get(addr: str, path: str, host: str, token: str | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(addr, port, timeout=10)
        headers = {"Host": host}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        try:
            conn.request("GET", path, headers=headers)
            r = conn.getresponse()
            out = (r.status, r.read())
        finally:
            conn.close()
        SEEN.append((f"GET {path}", out[1]))
        return out

    for addr in ("127.0.0.1", "::1"):
        for path, token in (("/metrics", None), ("/v1/secrets", tok)):
            for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}",
                         f"127.0.0.1:{port + 1}"):
                status, body = get(addr, path, host, token)
                assert status == 403, (addr, path, host, status)
                assert json.loads(body)["error"] == "forbidden_host", (addr, path, host)
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
                status, _ = get(addr, path, host, token)
                assert status == 200, (addr, path, host, status)


# ---------------------------------------------------------------------------------------------
# validation


def _pin(**kw):
    d = {"host": "api.test", "secret": "api_tok", "inject": {"type": "bearer"}}
    d.update(kw)
    return d


VALIDATION = [
    # (name, method, path, raw body, expected field in detail)
    ("bad_json_secret", "POST", "/v1/secrets", b'{"name": "x", "scope": ', "body"),
    ("bad_json_run", "POST", "/v1/runs", b"{not json", "body"),
    ("not_object", "POST", "/v1/runs", b"[1, 2]", "body"),
    ("secret_missing_scope", "POST", "/v1/secrets", {"name": "x", "value": "v"}, "scope"),
    ("secret_missing_org", "POST", "/v1/secrets",
     {"name": "x", "scope": {"project": "web"}, "value": "v"}, "scope.org"),
    ("secret_missing_value", "POST", "/v1/secrets", {"name": "x", "scope": {"org": "acme"}},
     "value"),
    ("secret_empty_value", "POST", "/v1/secrets",
     {"name": "x", "scope": {"org": "acme"}, "value": ""}, "value"),
    ("secret_crlf_value", "POST", "/v1/secrets",
     {"name": "x", "scope": {"org": "acme"}, "value": "a\r\nX-Injected: 1"}, "value"),
    ("secret_value_not_string", "POST", "/v1/secrets",
     {"name": "x", "scope": {"org": "acme"}, "value": 42}, "value"),
    ("secret_bad_name", "POST", "/v1/secrets",
     {"name": "a b/c", "scope": {"org": "acme"}, "value": "v"}, "name"),
    ("secret_unknown_field", "POST", "/v1/secrets",
     {"name": "x", "scope": {"org": "acme"}, "value": "v", "colour": "red"}, "colour"),
    ("run_missing_scope", "POST", "/v1/runs", {"pins": []}, "scope"),
    ("run_bad_scope_field", "POST", "/v1/runs", {"scope": {"org": "acme", "team": "x"}},
     "scope.team"),
    ("run_bad_ttl", "POST", "/v1/runs", {"scope": {"org": "acme"}, "ttl_seconds": "soon"},
     "ttl_seconds"),
    ("run_negative_ttl", "POST", "/v1/runs", {"scope": {"org": "acme"}, "ttl_seconds": -5},
     "ttl_seconds"),
    ("unknown_secret", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(secret="no_such_secret")]}, "pins[0].secret"),
    ("unknown_secret_second_pin", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(), _pin(host="other.test", secret="nope")]},
     "pins[1].secret"),
    ("secret_in_other_scope", "POST", "/v1/runs",
     {"scope": {"org": "globex"}, "pins": [_pin()]}, "pins[0].secret"),
    ("pin_missing_host", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [{"secret": "api_tok", "inject": {"type": "bearer"}}]},
     "pins[0].host"),
    ("pin_bad_inject_type", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(inject={"type": "sigv9"})]}, "pins[0].inject.type"),
    ("pin_basic_without_user", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(inject={"type": "basic"})]},
     "pins[0].inject.username"),
    ("pin_injects_content_length", "POST", "/v1/runs",
     {"scope": {"org": "acme"},
      "pins": [_pin(inject={"type": "header", "name": "Content-Length"})]}, "pins[0].inject.name"),
    ("pin_injects_host", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(inject={"type": "header", "name": "host"})]},
     "pins[0].inject.name"),
    ("pin_header_transfer_encoding", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(headers={"Transfer-Encoding": "chunked"})]},
     "pins[0].headers.transfer-encoding"),
    ("pin_header_content_length", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(headers={"content-length": "0"})]},
     "pins[0].headers.content-length"),
    ("pin_21_headers", "POST", "/v1/runs",
     {"scope": {"org": "acme"},
      "pins": [_pin(headers={f"x-h{i}": str(i) for i in range(21)})]}, "pins[0].headers"),
    ("pin_unknown_field", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(colour="red")]}, "pins[0].colour"),
    ("rotate_bad_json", "PUT", "/v1/secrets/api_tok", b"{", "body"),
    ("rotate_missing_scope", "PUT", "/v1/secrets/api_tok", {"value": "v"}, "scope"),
    ("rotate_empty_value", "PUT", "/v1/secrets/api_tok",
     {"scope": {"org": "acme"}, "value": ""}, "value"),
    ("pin_path_prefix", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(path_prefixes=["repos"])]}, "pins[0].path_prefixes"),
    # As the config refuses them: a query, fragment or space never matches a request's path,
    # so the pin would never inject.
    ("pin_path_prefix_query", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(path_prefixes=["/ok/", "/repos/acme?ref=main"])]},
     "pins[0].path_prefixes[1]: must be a plain path"),
    ("pin_path_prefix_fragment", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(path_prefixes=["/repos#x"])]},
     "pins[0].path_prefixes[0]: must be a plain path"),
    ("pin_path_prefix_space", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(path_prefixes=["/a b"])]},
     "pins[0].path_prefixes[0]: must be a plain path"),
    ("pins_not_array", "POST", "/v1/runs", {"scope": {"org": "acme"}, "pins": {}}, "pins"),
    # A key given twice: refused, not "the last one wins" (a proxy in front reading the first
    # would see another request than egressd acts on).
    ("secret_duplicate_name", "POST", "/v1/secrets",
     b'{"name": "dupA", "name": "dupB", "scope": {"org": "acme"}, "value": "v"}', "name"),
    ("secret_duplicate_scope_org", "POST", "/v1/secrets",
     b'{"name": "dup", "scope": {"org": "acme", "org": "other"}, "value": "v"}', "scope.org"),
    ("secret_duplicate_value", "POST", "/v1/secrets",
     b'{"name": "dup", "scope": {"org": "acme"}, "value": "a", "value": "b"}', "value"),
    ("rotate_duplicate_scope", "PUT", "/v1/secrets/api_tok",
     b'{"scope": {"org": "acme"}, "scope": {"org": "other"}, "value": "v"}', "scope"),
    ("run_duplicate_in_second_pin", "POST", "/v1/runs",
     b'{"scope": {"org": "acme"}, "pins": [{"host": "api.test", "secret": "api_tok", '
     b'"inject": {"type": "bearer"}}, {"host": "api.test", "secret": "api_tok", '
     b'"inject": {"type": "bearer", "type": "basic"}}]}', "pins[1].inject.type"),
    # inject takes only known options, and each type only its own (as in the config).
    ("pin_inject_misspelled_template", "POST", "/v1/runs",
     {"scope": {"org": "acme"},
      "pins": [_pin(inject={"type": "header", "name": "X-Api-Key", "templat": "Key {secret}"})]},
     "pins[0].inject.templat"),
    ("pin_bearer_with_username", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(inject={"type": "bearer", "username": "u"})]},
     "pins[0].inject.username"),
    ("pin_basic_with_template", "POST", "/v1/runs",
     {"scope": {"org": "acme"},
      "pins": [_pin(inject={"type": "basic", "username": "u", "template": "x {secret}"})]},
     "pins[0].inject.template"),
    ("pin_bearer_with_name", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(inject={"type": "bearer", "name": "x-key"})]},
     "pins[0].inject.name"),
    ("pin_aws_without_region", "POST", "/v1/runs",
     {"scope": {"org": "acme"},
      "pins": [_pin(inject={"type": "aws-sigv4", "access_key_id": "AKIAIOSFODNN7EXAMPLE",
                            "service": "s3"})]},
     "pins[0].inject.region"),
    ("pin_aws_bad_access_key_id", "POST", "/v1/runs",
     {"scope": {"org": "acme"},
      "pins": [_pin(inject={"type": "aws-sigv4", "access_key_id": "AKIA/x",
                            "region": "us-east-1", "service": "s3"})]},
     "pins[0].inject.access_key_id"),
    ("pin_bearer_with_region", "POST", "/v1/runs",
     {"scope": {"org": "acme"}, "pins": [_pin(inject={"type": "bearer", "region": "us-east-1"})]},
     "pins[0].inject.region"),
]


@pytest.mark.parametrize("name,method,path,body,field", VALIDATION, ids=[v[0] for v in VALIDATION])
def test_validation_errors_name_the_field(cp, api_secret, name, method, path, body, field):
    before = api_ok(cp, "GET", "/v1/secrets")
    if isinstance(body, bytes):
        r = api(cp, method, path, raw=body)
    else:
        r = api(cp, method, path, body)
    assert 400 <= r.status < 500, (r.status, r.body[:300])
    assert r.headers.get("content-type", "").startswith("application/json")
    j = r.json
    assert set(j) == {"error", "detail"}, j
    assert j["error"] == "invalid_request", j
    assert j["detail"].startswith(field) or f"{field}:" in j["detail"] or \
        f"{field} " in j["detail"], j["detail"]
    # The refused request changed nothing.
    assert api_ok(cp, "GET", "/v1/secrets") == before


def test_added_pin_is_validated_like_a_run_pin(cp, world, api_secret):
    run = create_run(cp, world, {"org": "acme"}, [])
    path = f"/v1/runs/{run.id}/pins"
    for raw, field in [
            (b'{"host": "api.test", "host": "other.test", "secret": "api_tok", '
             b'"inject": {"type": "bearer"}}', "pin.host"),
            (json.dumps(_pin(inject={"type": "bearer", "bogus": 1})).encode(),
             "pin.inject.bogus")]:
        r = api(cp, "POST", path, raw=raw)
        assert r.status == 400 and r.json["error"] == "invalid_request", (r.status, r.body)
        assert r.json["detail"].startswith(f"{field}:"), r.json["detail"]
    assert api_ok(cp, "GET", f"/v1/runs/{run.id}")["pins"] == []


def test_20_pin_headers_are_accepted(cp, api_secret, world):
    run = create_run(cp, world, {"org": "acme"},
                     [_pin(host=api_host(world), headers={f"x-h{i}": str(i) for i in range(20)})])
    assert len(run.reply["pins"][0]["headers"]) == 20


def test_duplicate_secret_is_a_conflict(cp, api_secret):
    r = api(cp, "POST", "/v1/secrets",
            {"name": "api_tok", "scope": {"org": "acme"}, "value": sval("dup")})
    assert r.status == 409 and r.json["error"] == "conflict", r.status


@pytest.mark.parametrize("query, why", [
    ("scope=", "empty"),
    ("scopes=org%3Dacme", "unknown parameter 'scopes'"),
    ("Scope=org%3Dacme", "unknown parameter 'Scope'"),
    ("org=acme", "unknown parameter 'org'"),
    ("scope=org%3Dacme&scope=org%3Dother", "given twice"),
])
def test_a_secret_delete_with_a_scope_it_cannot_read_deletes_nothing(cp, query, why):
    """Without a scope parameter DELETE /v1/secrets/{name} removes the name in every scope. An
    empty, misspelled, unknown or repeated parameter had been read as that: the secret went in
    every org. Now 400, naming the parameter, and both scopes keep their secret."""
    name = "del_" + pysecrets.token_hex(4)
    for org in ("acme", "other"):
        put_secret(cp, name, sval("del-" + org), org=org)
    r = api(cp, "DELETE", f"/v1/secrets/{name}?{query}")
    assert r.status == 400 and r.json["error"] == "invalid_request", (r.status, r.json)
    assert why in r.json["detail"], r.json
    left = {tuple(sorted(s["scope"].items())) for s in api_ok(cp, "GET", "/v1/secrets")["secrets"]
            if s["name"] == name}
    assert left == {(("org", "acme"),), (("org", "other"),)}, left
    # The explain route refuses unknown parameters the same way.
    r = api(cp, "GET", "/v1/runs/run_x/explain?url=https%3A%2F%2Fa.test%2F&methd=GET")
    assert r.status == 400 and "unknown parameter 'methd'" in r.json["detail"], r.json
    r = api(cp, "GET", "/v1/runs/run_x/explain?url=https%3A%2F%2Fa.test%2F&method=")
    assert r.status == 400 and "method: empty" in r.json["detail"], r.json
    # A scope that parses deletes that scope alone.
    assert api(cp, "DELETE", f"/v1/secrets/{name}?scope=org%3Dacme").status == 204
    left = [s["scope"] for s in api_ok(cp, "GET", "/v1/secrets")["secrets"] if s["name"] == name]
    assert left == [{"org": "other"}], left


def test_unknown_routes_and_objects_are_404(cp):
    assert api(cp, "GET", "/v1/runs/run_doesnotexist").status == 404
    assert api(cp, "DELETE", "/v1/runs/run_doesnotexist").status == 404
    assert api(cp, "GET", "/v1/nothing").status == 404
    r = api(cp, "DELETE", "/v1/secrets/never_existed", token=admin_token(cp))
    assert r.status == 404 and r.json["error"] == "not_found"


@pytest.mark.parametrize("method, path, allow", [
    ("PATCH", "/v1/secrets", "GET, POST"),
    ("GET", "/v1/secrets/some_name", "PUT, DELETE"),
    ("GET", "/v1/runs", "POST"),
    ("PUT", "/v1/runs/run_x", "GET, DELETE"),
    ("GET", "/v1/runs/run_x/pins", "POST"),
    ("POST", "/v1/runs/run_x/explain", "GET"),
    ("GET", "/v1/keys/rotate", "POST"),
    ("POST", "/healthz", "GET"),
    ("DELETE", "/metrics", "GET"),
    ("PUT", "/readyz", "GET"),
])
def test_a_known_route_with_another_method_is_405_with_allow(cp, method, path, allow):
    """A route that exists answers another method with 405 method_not_allowed and an Allow
    header listing its methods (RFC 9110 15.5.6), not 404; nothing is changed."""
    before = api(cp, "GET", "/v1/secrets").body
    r = api(cp, method, path, {} if method in ("PUT", "POST", "PATCH") else None)
    assert r.status == 405, (method, path, r.status, r.body[:200])
    assert r.json["error"] == "method_not_allowed", r.json
    assert r.headers.get("allow") == allow, r.headers
    assert api(cp, "GET", "/v1/secrets").body == before
    # the token is still checked first on /v1: without it, 401 says nothing about routes
    if path.startswith("/v1/"):
        assert api(cp, method, path, token=None).status == 401


# ---------------------------------------------------------------------------------------------
# secrets never come back; ciphertext at rest


def test_secrets_never_returned_by_any_response(cp, world, api_secret):
    v = sval("never")
    values = {"api_tok": api_secret, "never": v}
    created = put_secret(cp, "never_tok", v, org="acme", project="web")
    assert set(created) == {"name", "scope", "version", "created_at"}, sorted(created)
    v2 = sval("never2")
    values["never2"] = v2
    rotated = rotate_secret(cp, "never_tok", v2, org="acme", project="web")
    assert rotated["version"] == 2
    run = create_run(cp, world, {"org": "acme", "project": "web"},
                     [bearer_pin(api_host(world), "never_tok")], allow=["other.test"])
    api_ok(cp, "POST", f"/v1/runs/{run.id}/pins", bearer_pin("other.test", "api_tok"))
    api_ok(cp, "GET", f"/v1/runs/{run.id}")
    api_ok(cp, "GET", "/v1/secrets")
    from urllib.parse import quote
    api_ok(cp, "GET", f"/v1/runs/{run.id}/explain?url={quote(f'https://{api_host(world)}/x')}")
    ctl_ok(cp, "secret", "list")
    ctl_ok(cp, "secret", "list", "--json")
    ctl_ok(cp, "run", "show", run.id)
    ctl_ok(cp, "run", "explain", run.id, f"https://{api_host(world)}/x")
    ctl_ok(cp, "secret", "put", "never_ctl", "--scope", "org=acme", stdin=sval("ctl") + "\n")
    # The secret is used by a real request, whose response the upstream echoes (scrubbed).
    marker = "m-never-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    assert resp.status == 200
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v2}"],
           "upstream did not get the rotated value")
    expect(not contains_any(resp.body, values), "response echoed a secret unscrubbed")
    leaked = [(what, contains_any(body, values)) for what, body in SEEN
              if contains_any(body, values)]
    expect(not leaked, f"secret values in admin responses / egressctl output: "
                       f"{[(w_, n) for w_, n in leaked]}")
    assert len(SEEN) > 10


def test_ciphertext_at_rest(cp, api_secret):
    v = sval("rest")
    put_secret(cp, "rest_tok", v, org="acme")
    files = []
    for root, _d, names in os.walk(state_dir(cp)):
        files += [os.path.join(root, n) for n in names]
    assert files, "state folder is empty"
    found = []
    total = b""
    for p in files:
        with open(p, "rb") as f:
            data = f.read()
        total += data
        if contains_any(data, {"rest": v, "api": api_secret}):
            found.append(p)
    expect(not found, f"secret value (or its base64) in state files: {found}")
    assert b"rest_tok" in total, "the store should name the secret (metadata is not secret)"
    # Nothing egressd wrote anywhere (logs, audit, state) holds a value in clear.
    expect(not cp.leaks(), f"leaks: {[p for p, _ in cp.leaks()]}")
    mk = master_key_file(cp)
    assert stat.S_IMODE(os.stat(mk).st_mode) == 0o600
    assert os.path.getsize(mk) == 32
    assert stat.S_IMODE(os.stat(cp.config["admin"]["token_file"]).st_mode) == 0o600


# ---------------------------------------------------------------------------------------------
# scope resolution, explain


SCOPES = [  # (run scope, which secret value it must get)
    ({"org": "acme"}, "org"),
    ({"org": "acme", "project": "web"}, "project"),
    ({"org": "acme", "project": "api"}, "org"),
    ({"org": "acme", "project": "web", "user": "ana"}, "user"),
    ({"org": "acme", "project": "web", "user": "bob"}, "project"),
    ({"org": "acme", "project": "web", "user": "ana", "workflow": "nightly"}, "workflow"),
    ({"org": "acme", "project": "web", "user": "bob", "workflow": "nightly"}, "project"),
    ({"org": "acme", "project": "api", "user": "ana"}, "org"),
]


@pytest.fixture(scope="module")
def scoped(cp):
    vals = {k: sval(f"scope-{k}") for k in ("org", "project", "user", "workflow", "globex")}
    put_secret(cp, "gh", vals["org"], org="acme")
    put_secret(cp, "gh", vals["project"], org="acme", project="web")
    put_secret(cp, "gh", vals["user"], org="acme", project="web", user="ana")
    put_secret(cp, "gh", vals["workflow"], org="acme", project="web", user="ana",
               workflow="nightly")
    put_secret(cp, "gh", vals["globex"], org="globex")
    return vals


@pytest.mark.parametrize("scope,want", SCOPES, ids=[",".join(f"{k}={v}" for k, v in s.items())
                                                    for s, _ in SCOPES])
def test_scope_resolution_most_specific_wins(cp, world, scoped, scope, want):
    run = create_run(cp, world, scope, [bearer_pin(api_host(world), "gh")])
    marker = "m-scope-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    assert resp.status == 200, resp.status
    got = seen_auth(world.upstream, marker)
    names = {f"Bearer {v}": k for k, v in scoped.items()}
    expect(len(got) == 1 and got[0] in names,
           f"upstream got {len(got)} credential(s), none of the scoped secrets")
    assert names[got[0]] == want, f"run {scope} got the {names[got[0]]} secret, wants {want}"
    # explain agrees with what was injected
    ex = api_ok(cp, "GET", f"/v1/runs/{run.id}/explain?url=https://{api_host(world)}/echo")
    assert ex["secret"]["name"] == "gh"
    chosen = [c_["scope"] for c_ in ex["chain"] if c_["chosen"]]
    assert len(chosen) == 1 and chosen[0] == ex["secret"]["scope"]
    want_scope = {"org": {"org": "acme"}, "project": {"org": "acme", "project": "web"},
                  "user": {"org": "acme", "project": "web", "user": "ana"},
                  "workflow": {"org": "acme", "project": "web", "user": "ana",
                               "workflow": "nightly"}}[want]
    assert ex["secret"]["scope"] == want_scope, ex["secret"]


def test_scope_of_another_org_is_never_used(cp, world, scoped):
    run = create_run(cp, world, {"org": "globex", "project": "web"},
                     [bearer_pin(api_host(world), "gh")])
    marker = "m-globex-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    expect(seen_auth(world.upstream, marker) == [f"Bearer {scoped['globex']}"],
           "globex run did not get the globex secret")


def test_explain(cp, world, scoped):
    run = create_run(cp, world, {"org": "acme", "project": "web", "user": "ana"},
                     [bearer_pin(api_host(world), "gh", path_prefixes=["/repos/"],
                                 methods=["GET"])],
                     allow=["tunnel.test"])
    pin_id = run.reply["pins"][0]["id"]
    from urllib.parse import quote

    def explain(url, method=None):
        q = f"url={quote(url, safe='')}" + (f"&method={method}" if method else "")
        return api_ok(cp, "GET", f"/v1/runs/{run.id}/explain?{q}")

    ex = explain(f"https://{api_host(world)}/repos/acme/x?page=2")
    assert ex["decision"] == "inject", ex
    assert ex["pin"]["id"] == pin_id
    assert ex["secret"] == {"name": "gh", "scope": {"org": "acme", "project": "web",
                                                    "user": "ana"}, "version": 1}
    chain = {json.dumps(c["scope"], sort_keys=True): c for c in ex["chain"]}
    assert chain[json.dumps({"org": "acme"})]["matches"] is True
    assert chain[json.dumps({"org": "acme", "project": "web"}, sort_keys=True)]["matches"]
    assert chain[json.dumps({"org": "globex"})]["matches"] is False
    wf = json.dumps({"org": "acme", "project": "web", "user": "ana", "workflow": "nightly"},
                    sort_keys=True)
    assert chain[wf]["matches"] is False  # more specific than the run: not applicable
    assert sum(c["chosen"] for c in ex["chain"]) == 1

    # method and path outside the pin; unpinned hosts
    assert explain(f"https://{api_host(world)}/repos/x", "POST")["pin"] is None
    assert explain(f"https://{api_host(world)}/other")["pin"] is None
    d = explain(f"https://unlisted.test:{world.U}/")
    assert d["decision"] == "deny" and d["pin"] is None and d["reason"], d
    t = explain(f"https://tunnel.test:{world.U}/")
    assert t["decision"] == "tunnel", t
    r = api(cp, "GET", f"/v1/runs/{run.id}/explain?url=notaurl")
    assert r.status == 400 and r.json["detail"].startswith("url")

    # a pin without a port covers allowed_ports only: on a port another pin names, explain
    # names that pin, as the proxy does
    P = next(p for p in range(47001, 47100) if p not in cp.config["policy"]["allowed_ports"])
    two = create_run(cp, world, {"org": "acme", "project": "web", "user": "ana"},
                     [bearer_pin("other.test", "gh"),
                      {"host": f"other.test:{P}", "secret": "gh",
                       "inject": {"type": "header", "name": "x-api-key"}}])
    ex = api_ok(cp, "GET", f"/v1/runs/{two.id}/explain?url="
                           f"{quote(f'https://other.test:{P}/x', safe='')}")
    assert ex["pin"]["id"] == two.reply["pins"][1]["id"], ex
    api_ok(cp, "DELETE", f"/v1/runs/{two.id}")

    # the same through egressctl, human-readable
    out = ctl_ok(cp, "run", "explain", run.id, f"https://{api_host(world)}/repos/acme/x").out
    assert "decision: inject" in out, out
    assert pin_id in out
    assert "gh in org=acme,project=web,user=ana, version 1" in out, out
    assert "* org=acme,project=web,user=ana" in out, out
    out = ctl_ok(cp, "run", "explain", run.id, f"https://{api_host(world)}/repos/acme/x",
                 "--method", "DELETE").out
    assert "pin:      none" in out, out
    j = json.loads(ctl_ok(cp, "run", "explain", run.id, f"https://unlisted.test:{world.U}/",
                          "--json").out)
    assert j["decision"] == "deny"

    # revoked run
    api_ok(cp, "DELETE", f"/v1/runs/{run.id}")
    ex = explain(f"https://{api_host(world)}/repos/acme/x")
    assert ex["decision"] == "deny" and ex["reason"] == "run_revoked", ex


# ---------------------------------------------------------------------------------------------
# rotation, expiry, revocation


def test_rotated_secret_applies_to_next_request_on_same_connection(cp, world):
    v1, v2, v3 = sval("rot1"), sval("rot2"), sval("rot3")
    put_secret(cp, "rot_tok", v1, org="acme")
    run = create_run(cp, world, {"org": "acme"}, [bearer_pin(api_host(world), "rot_tok")])
    c = run.tunnel("api.test", world.U)
    try:
        m1 = "m-rot1-" + pysecrets.token_hex(3)
        r = helpers.request(c, "GET", f"/echo/{m1}", api_host(world))
        assert r.status == 200
        expect(seen_auth(world.upstream, m1) == [f"Bearer {v1}"], "first request: not v1")
        rotate_secret(cp, "rot_tok", v2, org="acme")
        m2 = "m-rot2-" + pysecrets.token_hex(3)
        r = helpers.request(c, "GET", f"/echo/{m2}", api_host(world))  # same connection
        assert r.status == 200
        expect(seen_auth(world.upstream, m2) == [f"Bearer {v2}"],
               "request after PUT on the same keep-alive connection did not use the new value")
        # rotate through egressctl (value on stdin), again on the same connection
        out = ctl_ok(cp, "secret", "rotate", "rot_tok", "--scope", "org=acme", stdin=v3 + "\n")
        cp.secrets["cp:rot3"] = v3
        assert "version 3" in out.out, out.out
        m3 = "m-rot3-" + pysecrets.token_hex(3)
        r = helpers.request(c, "GET", f"/echo/{m3}", api_host(world))
        assert r.status == 200
        expect(seen_auth(world.upstream, m3) == [f"Bearer {v3}"],
               "egressctl secret rotate: next request did not use the new value")
    finally:
        c.close()
    lst = {(s["name"], json.dumps(s["scope"])): s for s in api_ok(cp, "GET", "/v1/secrets")["secrets"]}
    assert lst[("rot_tok", json.dumps({"org": "acme"}))]["version"] == 3


def test_rotated_secret_applies_to_next_h2_stream_on_same_connection(cp, world):
    # Each h2 stream refreshes its run from its worker's copy of the runtime, which follows the
    # control plane's publish (Shared::runtime_gen); streams start from the connection's run.
    import types
    from h2_helpers import H2Client
    v1, v2 = sval("rh2a"), sval("rh2b")
    put_secret(cp, "rot_h2", v1, org="acme")
    run = create_run(cp, world, {"org": "acme"}, [bearer_pin(api_host(world), "rot_h2")])
    c = H2Client(cp, types.SimpleNamespace(auth=lambda _run: run.auth), "api.test", world.U,
                 ca=run.ca_file)
    try:
        m1 = "m-rh2a-" + pysecrets.token_hex(3)
        r = c.request(f"/echo/{m1}")
        assert r.get("status") == 200, r
        expect(seen_auth(world.upstream, m1) == [f"Bearer {v1}"], "first h2 stream: not v1")
        rotate_secret(cp, "rot_h2", v2, org="acme")
        for i in range(3):  # every later stream of the same connection, not just the next
            m = f"m-rh2b{i}-" + pysecrets.token_hex(3)
            r = c.request(f"/echo/{m}")
            assert r.get("status") == 200, r
            expect(seen_auth(world.upstream, m) == [f"Bearer {v2}"],
                   f"h2 stream {i} after PUT on the same connection did not use the new value")
    finally:
        c.close()


def test_pins_sharing_a_secret_follow_its_rotation(cp, world):
    """Pins that inject one secret the same way share one injection (policy::InjectionCache),
    and a rebuild keeps unchanged pins' injections: a rotation, and a pin added later, must
    still give every pin the current value, in its own form."""
    v1, v2 = sval("share1"), sval("share2")
    put_secret(cp, "share_tok", v1, org="acme")
    run = create_run(cp, world, {"org": "acme"},
                     [bearer_pin(api_host(world), "share_tok"),
                      bearer_pin(f"other.test:{world.U}", "share_tok"),
                      {"host": f"basic.test:{world.U}", "secret": "share_tok",
                       "inject": {"type": "basic", "username": "u"}}],
                     allow=["hdr.test"])  # the run's CA may certify it: a pin is added later

    def auth_seen(host: str) -> str:
        marker = "m-share-" + pysecrets.token_hex(3)
        c, resp = get_via(run, host, world.U, f"/echo/{marker}")
        c.close()
        assert resp.status == 200, (host, resp.status)
        seen = seen_auth(world.upstream, marker)
        assert len(seen) == 1, (host, len(seen))
        return seen[0]

    def basic(v: str) -> str:
        return "Basic " + base64.b64encode(f"u:{v}".encode()).decode()

    expect(auth_seen("api.test") == f"Bearer {v1}", "api.test: not v1")
    expect(auth_seen("other.test") == f"Bearer {v1}", "other.test: not v1")
    expect(auth_seen("basic.test") == basic(v1), "basic.test: not basic(v1)")
    rotate_secret(cp, "share_tok", v2, org="acme")
    expect(auth_seen("api.test") == f"Bearer {v2}", "api.test: not v2 after rotation")
    expect(auth_seen("other.test") == f"Bearer {v2}", "other.test: not v2 after rotation")
    expect(auth_seen("basic.test") == basic(v2), "basic.test: not basic(v2) after rotation")
    # A pin added later rebuilds the run; the unchanged pins keep injecting v2.
    api_ok(cp, "POST", f"/v1/runs/{run.id}/pins", bearer_pin(f"hdr.test:{world.U}", "share_tok"))
    expect(auth_seen("hdr.test") == f"Bearer {v2}", "added pin: not v2")
    expect(auth_seen("other.test") == f"Bearer {v2}", "other.test: not v2 after the rebuild")
    expect(auth_seen("basic.test") == basic(v2), "basic.test: not basic(v2) after the rebuild")


def test_run_expiry(cp, world, api_secret):
    run = create_run(cp, world, {"org": "acme"}, [bearer_pin(api_host(world), "api_tok")], ttl=2)
    pin_exp = run.reply["pins"][0]["expires_at"]
    assert pin_exp <= run.reply["expires_at"]  # RFC 3339 UTC: string order is time order
    open_conn = run.tunnel("api.test", world.U)
    marker = "m-exp-" + pysecrets.token_hex(3)
    r = helpers.request(open_conn, "GET", f"/echo/{marker}", api_host(world))
    assert r.status == 200
    expect(seen_auth(world.upstream, marker) == [f"Bearer {api_secret}"], "not injected")

    # Poll the open connection until the run expires: every answer before is a 200.
    results = []

    def refused_on_open():
        st, why = refused_or_closed(open_conn, api_host(world), f"/echo/{marker}-k")
        results.append((st, why))
        return st != 200
    helpers.poll(refused_on_open, 8.0, "the open connection to be refused after expiry",
                 interval=0.1)
    st, why = results[-1]
    assert st in (403, None), results[-1]
    if st == 403:
        assert why == "run_expired", why
    open_conn.close()

    # New CONNECTs are refused (403 run_expired until the sweep, then the run is unknown).
    def refused_new():
        c, resp = helpers.proxy_connect(run.proxy_port, api_host(world), run.auth)
        c.close()
        return resp if resp.status != 200 else None
    resp = helpers.poll(refused_new, 5.0, "new CONNECT refused after expiry", interval=0.1)
    assert (resp.status, resp.egress_reason) == (403, "run_expired")
    # At most a few seconds after expiry, the sweep has removed it.
    helpers.poll(lambda: api(cp, "GET", f"/v1/runs/{run.id}").status == 404, 5.0,
                 "expired run swept", interval=0.1)
    # after the sweep the run's own token still learns why (not a bare 407)
    c, resp = helpers.proxy_connect(run.proxy_port, api_host(world), run.auth)
    c.close()
    assert (resp.status, resp.egress_reason) == (403, "run_expired")
    if st == 403:
        cp.wait_audit(lambda a: a.get("run") == run.id and a.get("status") == 403
                      and a.get("reason") == "run_expired", 1)


def test_pin_ttl_is_capped_by_the_run(cp, world, api_secret):
    run = create_run(cp, world, {"org": "acme"},
                     [bearer_pin(api_host(world), "api_tok", ttl_seconds=3600)], ttl=60)
    assert run.reply["pins"][0]["expires_at"] == run.reply["expires_at"]
    api_ok(cp, "DELETE", f"/v1/runs/{run.id}")


def test_revocation_closes_open_connections_and_refuses_new_ones(cp, world, api_secret):
    run = create_run(cp, world, {"org": "acme"}, [bearer_pin(api_host(world), "api_tok")],
                     allow=["tunnel.test"])
    intercepted = run.tunnel("api.test", world.U)
    marker = "m-rev-" + pysecrets.token_hex(3)
    assert helpers.request(intercepted, "GET", f"/echo/{marker}", api_host(world)).status == 200
    # a blind tunnel (allowed, unpinned host) is open too
    c, resp = helpers.proxy_connect(run.proxy_port, f"tunnel.test:{world.U}", run.auth)
    assert resp.status == 200
    blind = helpers.tls_wrap(c, "tunnel.test", world.pki.ca)
    assert helpers.request(blind, "GET", f"/echo/{marker}-b", f"tunnel.test:{world.U}").status \
        == 200

    out = ctl_ok(cp, "run", "revoke", run.id).out
    assert f"run {run.id} revoked" in out

    st, why = refused_or_closed(intercepted, api_host(world), f"/echo/{marker}-after")
    assert st in (None, 403), (st, why)
    if st == 403:
        assert why == "run_revoked"
    assert not seen_auth(world.upstream, f"{marker}-after"), "a request went out after revoke"
    st, why = refused_or_closed(blind, f"tunnel.test:{world.U}", f"/echo/{marker}-b-after")
    assert st is None, f"blind tunnel still open after revocation: {st}"
    assert not world.upstream.find(f"{marker}-b-after")
    for target in (api_host(world), f"tunnel.test:{world.U}"):
        c, resp = helpers.proxy_connect(run.proxy_port, target, run.auth)
        c.close()
        assert (resp.status, resp.egress_reason) == (403, "run_revoked"), (target, resp.status)
    # a wrong token for the revoked run learns nothing: 407 as for an unknown run
    c, resp = helpers.proxy_connect(run.proxy_port, target,
                                    helpers.basic_auth(run.id, "not-the-token"))
    c.close()
    assert resp.status == 407
    shown = api_ok(cp, "GET", f"/v1/runs/{run.id}")
    assert shown["revoked"] is True
    # no pins can be added to a revoked run
    r = api(cp, "POST", f"/v1/runs/{run.id}/pins", bearer_pin("other.test", "api_tok"))
    assert r.status == 409


def test_connection_accepted_before_a_revoke_is_refused_at_its_first_head(cp, world):
    # The connection is accepted while the run is live and its CONNECT arrives after the
    # revoke: the identity is checked against the runtime of the head, not of the accept
    # (and a revoke racing the connection's registration is seen either way).
    run = create_run(cp, world, {"org": "acme"}, [], allow=["tunnel.test"])
    before = helpers.active_connections(cp)
    s = socket.create_connection(("127.0.0.1", run.proxy_port), timeout=10)
    c = helpers.Conn(s)
    helpers.poll(lambda: helpers.active_connections(cp) > before, 5.0,
                 "egressd to accept the connection before the revoke")
    api_ok(cp, "DELETE", f"/v1/runs/{run.id}")
    c.send(f"CONNECT tunnel.test:{world.U} HTTP/1.1\r\nHost: tunnel.test:{world.U}\r\n"
           f"Proxy-Authorization: {run.auth}\r\n\r\n".encode())
    r = helpers.read_response(c, connect=True)
    c.close()
    assert (r.status, r.egress_reason) == (403, "run_revoked")


def test_added_pin_applies_to_running_run(cp, world, api_secret):
    run = create_run(cp, world, {"org": "acme"}, [])
    c, resp = helpers.proxy_connect(run.proxy_port, f"basic.test:{world.U}", run.auth)
    c.close()
    assert resp.status == 403
    pin = api_ok(cp, "POST", f"/v1/runs/{run.id}/pins",
                 {"host": f"basic.test:{world.U}", "secret": "api_tok",
                  "inject": {"type": "basic", "username": "robot"}})
    assert pin["id"].startswith("pin_") and pin["inject"]["username"] == "robot"
    marker = "m-addpin-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "basic.test", world.U, f"/echo/{marker}")
    c.close()
    import base64
    want = "Basic " + base64.b64encode(f"robot:{api_secret}".encode()).decode()
    expect(seen_auth(world.upstream, marker) == [want], "basic pin added later not injected")


# ---------------------------------------------------------------------------------------------
# egressctl


def test_egressctl_secret_put_list_rm(cp, world):
    v = sval("ctl")
    r = ctl(cp, "secret", "put", "ctl_tok", "--scope", "org=acme", "--scope", "project=web",
            stdin=v + "\n")
    assert r.returncode == 0, r.err
    cp.secrets["cp:ctl"] = v
    assert "ctl_tok" in r.out and "version 1" in r.out
    # the newline was stripped: the value injected is exactly v
    run = create_run(cp, world, {"org": "acme", "project": "web"},
                     [bearer_pin(api_host(world), "ctl_tok")])
    marker = "m-ctl-" + pysecrets.token_hex(3)
    c, _ = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"], "stdin value not stored exactly")

    # again: 409, pointing at rotate; --rotate works
    r = ctl(cp, "secret", "put", "ctl_tok", "--scope", "org=acme,project=web", stdin=sval("x"))
    assert r.returncode == 1
    assert r.err.count("\n") == 1 and r.err.startswith("egressctl: 409 conflict: "), r.err
    assert "egressctl secret rotate ctl_tok" in r.err, r.err
    v2 = sval("ctl2")
    r = ctl(cp, "secret", "put", "--rotate", "ctl_tok", "--scope", "org=acme",
            "--scope", "project=web", stdin=v2)
    assert r.returncode == 0, r.err
    cp.secrets["cp:ctl2"] = v2
    assert "version 2" in r.out

    table = ctl_ok(cp, "secret", "list").out.splitlines()
    assert table[0].split() == ["NAME", "SCOPE", "VERSION", "CREATED_AT"], table[0]
    rows = [ln.split() for ln in table[1:]]
    assert ["ctl_tok", "org=acme,project=web", "2"] in [row[:3] for row in rows], table
    assert all(len(row) == 4 for row in rows), table

    # empty value refused, nothing stored
    for empty in ("", "\n"):
        r = ctl(cp, "secret", "put", "ctl_empty", "--scope", "org=acme", stdin=empty)
        assert r.returncode == 1 and "empty" in r.err, r.err
    assert "ctl_empty" not in ctl_ok(cp, "secret", "list").out

    r = ctl_ok(cp, "secret", "rm", "ctl_tok", "--scope", "org=acme", "--scope", "project=web")
    assert "deleted" in r.out
    assert "ctl_tok" not in ctl_ok(cp, "secret", "list").out
    r = ctl(cp, "secret", "rm", "ctl_tok")
    assert r.returncode == 1 and r.err.startswith("egressctl: 404 not_found"), r.err


def test_egressctl_value_never_an_argument(cp):
    # there is no way to pass the value as an argument
    for args in (["secret", "put", "x", "--scope", "org=acme", "--value", "v"],
                 ["secret", "put", "x", "v", "--scope", "org=acme"]):
        r = ctl(cp, *args, stdin="v")
        assert r.returncode == 2, (args, r.returncode, r.err)
        assert r.err.startswith("egressctl: ") and r.err.count("\n") == 1, r.err


def test_egressctl_reads_a_long_token_whole_and_never_echoes_a_value(factory, world):
    """egressd takes admin tokens up to 16 KiB; egressctl read --token-file with one read of
    1024 bytes, so a longer token was cut and every call got 401. And an argument starting
    with '-' that is no option (a value typed where it does not go) was echoed in the usage
    error; now it is named only when shaped like an option."""
    tok = pysecrets.token_urlsafe(1500)[:2000]

    def extra(cfg):
        path = cfg["admin"]["token_file"]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(tok + "\n")
    e = factory.start(mutate=cp_mutate(world, extra=extra))
    r = ctl(e, "secret", "list")
    assert r.returncode == 0, r.err
    value = "-Sv" + pysecrets.token_hex(8)
    r = ctl(e, "secret", "put", "n", "--scope", "org=acme", value, stdin="x")
    assert r.returncode == 2 and r.err.startswith("egressctl: unknown option"), r.err
    assert value not in r.err and value[1:] not in r.err, r.err
    r = ctl(e, "secret", "list", "--frobnicate")
    assert r.returncode == 2 and "'--frobnicate'" in r.err, r.err


def test_egressctl_errors(cp, world, api_secret):
    r = ctl(cp, "run", "create", "--scope", "org=acme", "--pin", f"{api_host(world)}=x:bearer")
    assert r.returncode == 1
    assert r.err == "egressctl: 400 invalid_request: pins[0].secret: unknown secret 'x' for " \
                    "scope org=acme\n", r.err
    assert r.out == ""
    r = ctl(cp, "run", "create", "--scope", "org=acme",
            "--pin", f"{api_host(world)}=api_tok:header:Content-Length")
    assert r.returncode == 1 and "pins[0].inject.name" in r.err, r.err
    # usage errors: exit 2, one line
    for args in (["run", "create"], ["run", "create", "--scope", "org=acme", "--pin", "nohost"],
                 ["run", "create", "--scope", "org=acme", "--ttl", "5x"],
                 ["frobnicate"], ["secret"], ["run", "show"], ["secret", "put", "n"],
                 ["run", "create", "--scope", "team=x"]):
        r = ctl(cp, *args)
        assert r.returncode == 2, (args, r.returncode, r.err)
        assert r.err.startswith("egressctl: ") and r.err.count("\n") == 1, (args, r.err)
    # auth errors: wrong token from the environment; no token at all
    tok = admin_token(cp)
    r = ctl(cp, "secret", "list", token_file=False,
            env=helpers.clean_env(EGRESSD_ADMIN_TOKEN="wrong-" + tok[:4]))
    assert r.returncode == 1 and r.err.startswith("egressctl: 401 unauthorized"), r.err
    env = helpers.clean_env()
    env.pop("EGRESSD_ADMIN_TOKEN", None)
    r = ctl(cp, "secret", "list", token_file=False, env=env)
    assert r.returncode == 2 and "EGRESSD_ADMIN_TOKEN" in r.err, r.err
    r = ctl_ok(cp, "secret", "list", token_file=False,
               env=helpers.clean_env(EGRESSD_ADMIN_TOKEN=tok))
    assert "NAME" in r.out
    # unreachable admin API
    r = subprocess.run([egressctl_bin(), "--admin", f"http://127.0.0.1:{world.closed_port}",
                        "secret", "list"], capture_output=True, timeout=30,
                       env=helpers.clean_env(EGRESSD_ADMIN_TOKEN=tok))
    err = r.stderr.decode()
    assert r.returncode == 1 and "cannot reach the admin API" in err, err
    # the admin token is never printed, whatever happened
    for what, body in SEEN:
        assert tok.encode() not in body, f"admin token printed by {what}"


def test_egressctl_help_is_a_command_or_an_option_never_a_value(cp):
    """The word help anywhere printed the usage and exited 0: `secret put help --scope ...`
    stored nothing and reported success. help is the command (or subcommand) word, -h and
    --help are options; a value that reads "help" is a value."""
    v = sval("help")
    r = ctl(cp, "secret", "put", "help", "--scope", "org=helpful", stdin=v)
    assert r.returncode == 0, r.err
    cp.secrets["cp:help"] = v
    assert r.out.startswith("secret help (org=helpful) stored: version 1"), r.out
    listed = json.loads(ctl_ok(cp, "secret", "list", "--json").out)["secrets"]
    assert [s["scope"] for s in listed if s["name"] == "help"] == [{"org": "helpful"}], listed
    r = ctl(cp, "run", "show", "help")
    assert r.returncode == 1 and r.err.startswith("egressctl: 404"), r.err
    for args in (["help"], ["--help"], ["-h"], ["secret", "help"], ["secret", "--help"],
                 ["run", "create", "--help"], ["secret", "put", "x", "-h"],
                 ["--timeout", "5s", "help"]):
        r = ctl(cp, *args)
        assert r.returncode == 0 and r.out.startswith("usage: egressctl"), (args, r.err)
    ctl_ok(cp, "secret", "rm", "help", "--scope", "org=helpful")


def test_egressctl_gives_up_on_an_admin_api_that_never_answers():
    """A listener that accepts and never answers (a wedged egressd, an admin call stuck behind
    a stalled state store): egressctl used to wait forever (its 30 s only bounded Beast's
    asynchronous operations, and it made synchronous ones). With --timeout 1s it exits 1
    within a few seconds, naming the endpoint and the timeout, over TCP and a unix socket."""
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix="ectl-", dir="/tmp")  # short: a unix socket path is bounded
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    sock_path = os.path.join(d, "silent.sock")
    ux = socket.socket(socket.AF_UNIX)
    ux.bind(sock_path)
    ux.listen(8)
    stop = threading.Event()
    held = []

    def hold(ls):  # accept, read nothing, answer nothing
        ls.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = ls.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            held.append(c)

    threads = [threading.Thread(target=hold, args=(s,), daemon=True) for s in (tcp, ux)]
    for t in threads:
        t.start()
    try:
        for admin in (f"http://127.0.0.1:{tcp.getsockname()[1]}", f"unix:{sock_path}"):
            t0 = time.monotonic()
            r = subprocess.run([egressctl_bin(), "--admin", admin, "--timeout", "1s", "secret",
                                "list"], capture_output=True, timeout=20,
                               env=helpers.clean_env(EGRESSD_ADMIN_TOKEN="not-a-real-token"))
            took = time.monotonic() - t0
            err = r.stderr.decode()
            assert r.returncode == 1, (admin, r.returncode, err)
            assert err == (f"egressctl: timed out after 1s waiting for an answer from the admin "
                           f"API at {admin} (--timeout 1s)\n"), err
            assert took < 5, (admin, took)
        assert len(held) >= 2, "egressctl never connected"
        # a timeout that is no duration is a usage error
        for bad in ("0", "5x", "", "2d"):
            r = subprocess.run([egressctl_bin(), "--timeout", bad, "secret", "list"],
                               capture_output=True, timeout=20,
                               env=helpers.clean_env(EGRESSD_ADMIN_TOKEN="not-a-real-token"))
            assert r.returncode == 2 and b"--timeout" in r.stderr, (bad, r.stderr)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for s in held + [tcp, ux]:
            s.close()
        shutil.rmtree(d, ignore_errors=True)


def test_egressctl_timeout_bounds_a_stalled_name_lookup():
    """The admin host's name lookup is getaddrinfo on Asio's resolver thread, which the
    io_context's destructor joined: with a DNS server that never answers, --timeout 1s ended
    only when resolv.conf's retries did (5 s x 2 attempts, for A and AAAA). egressctl runs in
    a mount namespace of its own whose /etc/resolv.conf names a UDP socket of the test's on
    127.0.0.153:53 that reads the queries and answers none (root and unshare needed)."""
    import shutil
    import tempfile
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace for /etc/resolv.conf)")
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        dns.bind(("127.0.0.153", 53))
    except OSError as e:
        dns.close()
        pytest.skip(f"cannot bind 127.0.0.153:53: {e}")
    d = tempfile.mkdtemp(prefix="ectl-dns-", dir="/tmp")
    conf = os.path.join(d, "resolv.conf")
    with open(conf, "w") as f:
        f.write("nameserver 127.0.0.153\noptions timeout:5 attempts:2\n")
    queries = []
    stop = threading.Event()

    def swallow():  # read every query, answer none
        dns.settimeout(0.2)
        while not stop.is_set():
            try:
                queries.append(dns.recv(512))
            except socket.timeout:
                continue
            except OSError:
                return

    t = threading.Thread(target=swallow, daemon=True)
    t.start()
    try:
        admin = "http://egressd-admin.stall.invalid:9901"
        script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        t0 = time.monotonic()
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                            conf, egressctl_bin(), "--admin", admin, "--timeout", "1s",
                            "secret", "list"],
                           capture_output=True, timeout=40,
                           env=helpers.clean_env(EGRESSD_ADMIN_TOKEN="not-a-real-token"))
        took = time.monotonic() - t0
        err = r.stderr.decode()
        if r.returncode != 1 and "mount" in err:
            pytest.skip(f"cannot bind-mount /etc/resolv.conf here: {err.strip()}")
        assert queries, "egressctl's lookup never reached the test's DNS socket"
        assert r.returncode == 1, (r.returncode, err)
        assert err == (f"egressctl: timed out after 1s looking up the admin API at {admin} "
                       f"(--timeout 1s)\n"), err
        assert took < 5, took
    finally:
        stop.set()
        t.join(5)
        dns.close()
        shutil.rmtree(d, ignore_errors=True)


def test_egressctl_sends_an_indented_credentials_document_compact(cp, world):
    """`aws sts assume-role --query Credentials` prints its document indented over several
    lines, and a secret holds no line break: egressctl sends a JSON object compact (one
    line; the API itself refuses the indented one), and the document is read as one (no
    "credentials document" warning for its pin, where a value that is none gets one)."""
    doc = {"AccessKeyId": "ASIAEGRESSTEMP000009",
           "SecretAccessKey": sval("sts-key").replace("-", "")[:40],
           "SessionToken": "FwoGZXIvYXdz" + pysecrets.token_hex(40),
           "Expiration": "2026-12-07T00:00:00+00:00"}
    helpers.secret(doc["SessionToken"])
    indented = json.dumps(doc, indent=4) + "\n"
    r = api(cp, "POST", "/v1/secrets", {"name": "sts_doc_api", "scope": {"org": "acme"},
                                        "value": indented.rstrip("\n")})
    assert r.status == 400 and "CR, LF or NUL" in r.json["detail"], (r.status, r.body[:200])
    ctl_ok(cp, "secret", "put", "sts_doc", "--scope", "org=acme", stdin=indented)
    ctl_ok(cp, "secret", "put", "sts_bad", "--scope", "org=acme", stdin="not a document\n")
    for name in ("sts_doc", "sts_bad"):
        ctl_ok(cp, "run", "create", "--scope", "org=acme",
               "--pin", f"{name}.test:{world.U}={name}:aws-sigv4::us-east-1:dynamodb")
    helpers.poll(lambda: "credentials document: not JSON" in cp.stderr_text(), 10,
                 "the warning for the value that is no document")
    warned = [ln for ln in cp.stderr_text().splitlines() if "credentials document" in ln]
    assert warned and not [ln for ln in warned if "sts_doc.test" in ln], warned


def test_egressctl_run_create_show_revoke(cp, world, api_secret):
    r = ctl_ok(cp, "run", "create", "--scope", "org=acme", "--scope", "user=ana",
               "--pin", f"{api_host(world)}=api_tok:bearer",
               "--pin", f"basic.test:{world.U}=api_tok:basic:robot",
               "--pin", f"hdr.test:{world.U}=api_tok:header:X-Api-Key",
               "--pin", f"s3.test:{world.U}=api_tok:aws-sigv4:AKIAIOSFODNN7EXAMPLE:eu-west-1:s3",
               "--pin", f"ddb.test:{world.U}=api_tok:aws-sigv4::us-east-1:dynamodb",
               "--allow", "tunnel.test", "--ttl", "10m")
    j = json.loads(r.out)
    for k in ("id", "proxy_url", "expires_at", "pins"):
        assert k in j, k
    assert [p["inject"]["type"] for p in j["pins"]] == ["bearer", "basic", "header", "aws-sigv4",
                                                         "aws-sigv4"]
    assert j["pins"][2]["inject"]["name"] == "x-api-key"
    assert j["pins"][3]["inject"] == {"type": "aws-sigv4", "access_key_id": "AKIAIOSFODNN7EXAMPLE",
                                      "region": "eu-west-1", "service": "s3"}
    # no key id: the secret is a credentials document
    assert j["pins"][4]["inject"] == {"type": "aws-sigv4", "region": "us-east-1",
                                      "service": "dynamodb"}
    show = json.loads(ctl_ok(cp, "run", "show", j["id"]).out)
    assert show["id"] == j["id"] and show["allow_hosts"] == ["tunnel.test"]
    assert show["scope"] == {"org": "acme", "user": "ana"}
    rid, tok = j["proxy_url"].split("//")[1].split("@")[0].split(":")
    assert tok not in json.dumps(show), "run show must not return the proxy token"
    # ttl 10m
    exp = time.strptime(show["expires_at"], "%Y-%m-%dT%H:%M:%SZ")
    created = time.strptime(show["created_at"], "%Y-%m-%dT%H:%M:%SZ")
    import calendar
    assert calendar.timegm(exp) - calendar.timegm(created) == 600
    ctl_ok(cp, "run", "revoke", j["id"])
    assert json.loads(ctl_ok(cp, "run", "show", j["id"]).out)["revoked"] is True


def test_egressctl_narrowed_pins_and_run_pin(cp, world, api_secret):
    """--path, --method and --header narrow the command's pins (the run DESIGN shows: one
    path prefix, GET only, 10 minutes); `run pin` adds one pin to a run, with its own ttl
    (never past the run's end); both as the API stores them. Usage errors exit 2."""
    r = ctl_ok(cp, "run", "create", "--scope", "org=acme",
               "--pin", f"{api_host(world)}=api_tok:bearer",
               "--path", "/repos/acme/", "--method", "GET",
               "--header", "X-Api-Version=2022-11-28", "--ttl", "10m")
    j = json.loads(r.out)
    [pin] = j["pins"]
    assert pin["path_prefixes"] == ["/repos/acme/"] and pin["methods"] == ["GET"], pin
    assert pin["headers"] == ["x-api-version"], pin  # names only, as the API shows them
    # (a pin added later stays inside the names the run's CA was constrained to at creation)
    r = ctl_ok(cp, "run", "pin", j["id"], "--pin", f"{api_host(world)}=api_tok:header:X-Key",
               "--path", "/upload/", "--method", "POST", "--ttl", "2m")
    added = json.loads(r.out)
    show = json.loads(ctl_ok(cp, "run", "show", j["id"]).out)
    assert len(show["pins"]) == 2, show["pins"]
    new = [p for p in show["pins"] if p["path_prefixes"] == ["/upload/"]]
    assert len(new) == 1 and new[0]["methods"] == ["POST"], show["pins"]
    assert new[0]["inject"] == {"type": "header", "name": "x-key", "template": "{secret}"}, new
    assert added["id"] == new[0]["id"], (added, new)
    import calendar
    ttl = (calendar.timegm(time.strptime(new[0]["expires_at"], "%Y-%m-%dT%H:%M:%SZ"))
           - calendar.timegm(time.strptime(show["created_at"], "%Y-%m-%dT%H:%M:%SZ")))
    assert 100 <= ttl <= 125, ttl
    for args in (["run", "create", "--scope", "org=acme", "--path", "/x"],
                 ["run", "create", "--scope", "org=acme", "--pin", "a.test=api_tok:bearer",
                  "--path", "nope"],
                 ["run", "create", "--scope", "org=acme", "--pin", "a.test=api_tok:bearer",
                  "--header", "novalue"],
                 ["run", "pin", j["id"]],
                 ["run", "pin", j["id"], "--pin", "a.test=api_tok:bearer",
                  "--pin", "b.test=api_tok:bearer"],
                 ["run", "pin", "--pin", "a.test=api_tok:bearer"]):
        r = ctl(cp, *args)
        assert r.returncode == 2, (args, r.returncode, r.err)
        assert r.err.startswith("egressctl: ") and r.err.count("\n") == 1, (args, r.err)
    r = ctl(cp, "run", "pin", "run_doesnotexist", "--pin", "a.test=api_tok:bearer")
    assert r.returncode == 1 and r.err.startswith("egressctl: 404"), r.err


def test_egressctl_ca_out_never_follows_a_name_planted_beside_it(cp, world, api_secret,
                                                                   tmp_path):
    """--ca-out in a shared folder: a symlink planted at the name egressctl used for its
    temporary file (<path>.tmp.<pid>; the pid is the shell's, kept by exec) is neither
    followed nor truncated, and the CA lands as a regular file."""
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    ca = tmp_path / "ca.pem"
    cmd = [egressctl_bin(), "--admin", f"http://127.0.0.1:{cp.admin_port}", "--token-file",
           cp.config["admin"]["token_file"], "run", "create", "--scope", "org=acme", "--pin",
           f"{api_host(world)}=api_tok:bearer", "--ca-out", str(ca)]
    r = subprocess.run(["bash", "-c", 'ln -s "$1" "$2.tmp.$$" && exec "${@:3}"', "_",
                        str(victim), str(ca), *cmd], capture_output=True, timeout=30,
                       env=helpers.clean_env())
    SEEN.append(("egressctl run create --ca-out", r.stdout + r.stderr))
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "untouched\n"
    assert not os.path.islink(ca) and ca.read_text().startswith("-----BEGIN CERTIFICATE-----")


def test_egressctl_run_create_leaves_no_run_when_its_files_cannot_be_written(cp, world,
                                                                             api_secret,
                                                                             tmp_path):
    """run create made the run, then wrote --ca-out / --ca-bundle-out: an unwritable path
    printed the write error alone and left a run nobody could find (id and proxy token never
    printed; counted toward admin.max_runs until it expired). The files are now created
    before the run, so such a path leaves no run and no temporary file; a file that fails
    after the run exists (the path is a folder) has the run revoked, and says so."""
    def runs():
        return {r["id"]: r.get("revoked", False) for r in _read_state(cp)["runs"]}

    before = runs()
    pin = f"{api_host(world)}=api_tok:bearer"
    for args, flag in ((["--ca-out", "/nonexistent/dir/ca.pem"], "--ca-out"),
                       (["--env", "--ca-out", str(tmp_path / "ca.pem"),
                         "--ca-bundle-out", "/nonexistent/dir/bundle.pem"], "--ca-bundle-out")):
        r = ctl(cp, "run", "create", "--scope", "org=acme", "--pin", pin, *args)
        assert r.returncode == 1 and r.out == "", (args, r.returncode, r.out, r.err)
        assert r.err.startswith(f"egressctl: {flag} /nonexistent/dir/"), r.err
        assert r.err.count("\n") == 1, r.err
        assert runs() == before, (args, "a run was made")
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
    # A path that is a folder is now refused before the run is made (a usage error); a file
    # that fails after the run exists has the run revoked: see
    # test_egressctl_run_create_revokes_the_run_and_keeps_the_ca_file_when_the_bundle_fails.
    folder = tmp_path / "a-folder"
    folder.mkdir()
    r = ctl(cp, "run", "create", "--scope", "org=acme", "--pin", pin, "--ca-out", str(folder))
    assert r.returncode == 2 and r.out == "", (r.returncode, r.out, r.err)
    assert r.err.startswith(f"egressctl: --ca-out {folder}: is a directory"), r.err
    assert runs() == before, "a run was made"
    assert os.listdir(tmp_path) == ["a-folder"] and os.listdir(folder) == []


def test_egressctl_run_create_refuses_an_output_path_that_is_no_file(cp, world, api_secret,
                                                                     tmp_path):
    """--ca-bundle-out naming a folder was found only at its rename, after the run was made
    and after --ca-out had been renamed into place: ca.pem then held the CA of a run egressctl
    revoked. An output path that exists and is not a regular file or a symlink (a folder, a
    FIFO) is now a usage error before any run is made, and leaves --ca-out as it was."""
    def runs():
        return {r["id"]: r.get("revoked", False) for r in _read_state(cp)["runs"]}

    before = runs()
    pin = f"{api_host(world)}=api_tok:bearer"
    ca = tmp_path / "ca.pem"
    ca.write_text("the CA file as it was\n")
    folder = tmp_path / "bundle-dir"
    folder.mkdir()
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    for args, flag, what in (
            (["--ca-out", str(ca), "--ca-bundle-out", str(folder)], "--ca-bundle-out",
             "a directory"),
            (["--env", "--ca-out", str(ca), "--ca-bundle-out", str(folder),
              "--system-ca-file", str(world.pki.ca)], "--ca-bundle-out", "a directory"),
            (["--ca-out", str(fifo)], "--ca-out", "a FIFO")):
        r = ctl(cp, "run", "create", "--scope", "org=acme", "--pin", pin, *args)
        assert r.returncode == 2 and r.out == "", (args, r.returncode, r.out, r.err)
        target = folder if flag == "--ca-bundle-out" else fifo
        assert r.err.startswith(f"egressctl: {flag} {target}: is {what}, not a file"), r.err
        assert r.err.count("\n") == 1, r.err
        assert runs() == before, (args, "a run was made")
        assert ca.read_text() == "the CA file as it was\n", args
        assert sorted(os.listdir(tmp_path)) == ["a-fifo", "bundle-dir", "ca.pem"], args
        assert os.listdir(folder) == []
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


class _FakeAdmin:
    """A loopback admin API for what egressd will not do on demand: `answer(method, target)`
    returns the raw response bytes after the request was read whole, or None for no answer
    (the connection is held), or b"" to close without one."""

    def __init__(self, answer):
        self.answer = answer
        self.seen: list[tuple[str, str]] = []
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(8)
        self.ls.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.ls.getsockname()[1]}"
        self.stop = threading.Event()
        self.held: list[socket.socket] = []
        self.t = threading.Thread(target=self._serve, daemon=True)
        self.t.start()

    def _serve(self):
        while not self.stop.is_set():
            try:
                c, _ = self.ls.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.held.append(c)
            c.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = c.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = 0
                for line in lines[1:]:
                    k, _, v = line.partition(":")
                    if k.strip().lower() == "content-length":
                        length = int(v.strip())
                while len(body) < length:
                    chunk = c.recv(65536)
                    if not chunk:
                        break
                    body += chunk
            except OSError:
                continue
            method, target = (lines[0].split(" ") + ["", ""])[:2]
            self.seen.append((method, target))
            out = self.answer(method, target)
            if out is None:
                continue
            try:
                c.sendall(out)
            except OSError:
                pass
            c.close()

    def close(self):
        self.stop.set()
        self.t.join(5)
        for s in self.held + [self.ls]:
            s.close()


def _ctl_at(admin: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([egressctl_bin(), "--admin", admin, *args], capture_output=True,
                          timeout=30, env=helpers.clean_env(EGRESSD_ADMIN_TOKEN="not-a-real-token"))


def test_egressctl_run_create_revokes_the_run_and_keeps_the_ca_file_when_the_bundle_fails(
        world, tmp_path):
    """The bundle is renamed into place before the CA file: when its rename fails after the run
    was made (here the path turns into a folder while the run is being created), the run is
    revoked and --ca-out still holds what it held. The CA file was renamed first, so it held
    the CA of the run egressctl then revoked."""
    ca = tmp_path / "ca.pem"
    ca.write_text("the CA file as it was\n")
    bundle = tmp_path / "bundle.pem"
    run = {"id": "run_fake", "proxy_url": "http://run_fake:x@127.0.0.1:9",
           "expires_at": "2099-01-01T00:00:00Z",
           "ca_pem": "-----BEGIN CERTIFICATE-----\nZmFrZQ==\n-----END CERTIFICATE-----\n"}

    def answer(method, target):
        if method == "POST" and target == "/v1/runs":
            bundle.mkdir()  # after egressctl checked its paths, before it renames
            body = json.dumps(run).encode()
            return (b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: " + str(len(body)).encode() +
                    b"\r\n\r\n" + body)
        if method == "DELETE" and target == "/v1/runs/run_fake":
            return b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
        return b"HTTP/1.1 404 Not Found\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"

    fake = _FakeAdmin(answer)
    try:
        r = _ctl_at(fake.url, "run", "create", "--scope", "org=acme", "--ca-out", str(ca),
                    "--ca-bundle-out", str(bundle), "--system-ca-file", str(world.pki.ca))
    finally:
        fake.close()
    err = r.stderr.decode()
    assert r.returncode == 1 and r.stdout == b"", (r.returncode, r.stdout, err)
    assert err == (f"egressctl: --ca-bundle-out {bundle}: Is a directory; "
                   f"run run_fake revoked\n"), err
    assert fake.seen == [("POST", "/v1/runs"), ("DELETE", "/v1/runs/run_fake")], fake.seen
    assert ca.read_text() == "the CA file as it was\n", "--ca-out holds a revoked run's CA"
    assert sorted(os.listdir(tmp_path)) == ["bundle.pem", "ca.pem"], os.listdir(tmp_path)
    assert os.listdir(bundle) == []


def test_egressctl_run_create_says_a_run_may_exist_when_its_answer_never_came():
    """--timeout ran out (or the connection broke) after the POST was sent: egressd may have
    made the run, and its id, which only the answer carries, is unknown. The message said only
    that the call timed out; it now says the run may have been created. A call that never got
    to send its request says nothing of the kind."""
    for mode in ("hold", "close"):
        fake = _FakeAdmin(lambda m, t: None if mode == "hold" else b"")
        try:
            r = _ctl_at(fake.url, "--timeout", "1s", "run", "create", "--scope", "org=acme")
        finally:
            fake.close()
        err = r.stderr.decode()
        assert r.returncode == 1 and r.stdout == b"", (mode, r.returncode, err)
        assert fake.seen == [("POST", "/v1/runs")], (mode, fake.seen)
        if mode == "hold":
            assert err.startswith(f"egressctl: timed out after 1s waiting for an answer from the "
                                  f"admin API at {fake.url} (--timeout 1s): "), err
        else:
            assert err.startswith(f"egressctl: cannot reach the admin API at {fake.url}: "), err
        assert err.endswith(": the run may have been created; its id is unknown (no answer "
                            "named it: it would be in egressd's state store, and ends at its "
                            "ttl)\n"), (mode, err)
        assert err.count("\n") == 1, err
    # nothing listening: the request was never sent, so no run can exist
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    r = _ctl_at(f"http://127.0.0.1:{port}", "--timeout", "1s", "run", "create", "--scope",
                "org=acme")
    err = r.stderr.decode()
    assert r.returncode == 1 and "may have been created" not in err, err


def test_egressctl_env_output_is_shell_safe(cp, world, api_secret, tmp_path):
    ca = tmp_path / "it's a dir" / "ca.pem"
    ca.parent.mkdir()
    r = ctl_ok(cp, "run", "create", "--scope", "org=acme",
               "--pin", f"{api_host(world)}=api_tok:bearer", "--env", "--ca-out", str(ca))
    names = ["HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
             "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE", "https_proxy",
             "http_proxy", "no_proxy"]
    exported = {}
    for line in r.out.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        assert line.startswith("export "), line
        k, _, v = line[len("export "):].partition("=")
        exported[k] = shlex.split(v)[0]
    assert sorted(exported) == sorted(names)
    assert exported["NODE_EXTRA_CA_CERTS"] == str(ca)
    assert exported["SSL_CERT_FILE"] == str(ca.parent / "ca-bundle.pem")
    assert os.path.isabs(exported["SSL_CERT_FILE"])
    assert exported["NO_PROXY"] == "localhost,127.0.0.1,::1"
    assert exported["HTTPS_PROXY"].startswith("http://run_")
    with open(ca) as f:
        assert f.read().startswith("-----BEGIN CERTIFICATE-----")
    # eval in a shell gives back exactly the same values
    dump = subprocess.run(["bash", "-c", 'eval "$1"; env -0', "_", r.out], capture_output=True,
                          env={}, timeout=30).stdout
    env = dict(kv.split("=", 1) for kv in dump.decode().split("\0") if "=" in kv)
    for k in names:
        assert env.get(k) == exported[k], k


def test_egressctl_over_unix_socket(factory, world):
    import conftest
    from cp_helpers import UnixAdminEgressd
    wd = world.new_dir("egressd-unix-")
    cfg = conftest.base_config(world, wd)
    cp_mutate(world)(cfg)
    sock = os.path.join(wd, "admin.sock")
    e = UnixAdminEgressd(factory.binary, wd, cfg, world.secrets, sock)
    factory.started.append(e)
    e.start()
    tokf = cfg["admin"]["token_file"]
    base = [egressctl_bin(), "--admin", f"unix:{sock}", "--token-file", tokf]
    v = sval("unix")
    e.secrets["cp:unix"] = v
    r = subprocess.run(base + ["secret", "put", "unix_tok", "--scope", "org=acme"],
                       input=v.encode(), capture_output=True, timeout=30, env=helpers.clean_env())
    assert r.returncode == 0, r.stderr
    r = subprocess.run(base + ["secret", "list"], capture_output=True, timeout=30,
                       env=helpers.clean_env())
    assert r.returncode == 0 and b"unix_tok" in r.stdout, r.stderr
    r = subprocess.run(base + ["run", "create", "--scope", "org=acme",
                               "--pin", f"{api_host(world)}=unix_tok:bearer"],
                       capture_output=True, timeout=30, env=helpers.clean_env())
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    from cp_helpers import DynRun, parse_proxy_url
    rid, tok, port = parse_proxy_url(j["proxy_url"])
    ca = os.path.join(wd, "unix-run-ca.pem")
    with open(ca, "w") as f:
        f.write(j["ca_pem"])
    run = DynRun(rid, tok, ca, port, j)
    marker = "m-unix-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"], "not injected (unix admin)")
    # wrong token over the unix socket: still 401
    r = subprocess.run([egressctl_bin(), "--admin", f"unix:{sock}", "secret", "list"],
                       capture_output=True, timeout=30,
                       env=helpers.clean_env(EGRESSD_ADMIN_TOKEN="nope"))
    assert r.returncode == 1 and r.stderr.startswith(b"egressctl: 401"), r.stderr


# ---------------------------------------------------------------------------------------------
# key rotation, restart, crash safety (each on its own egressd and state folder)


def test_kek_rotation(factory, world):
    e = factory.start(mutate=cp_mutate(world))
    v = sval("kek")
    put_secret(e, "kek_tok", v, org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(api_host(world), "kek_tok")])
    mk = master_key_file(e)
    with open(mk, "rb") as f:
        old_key = f.read()

    def state_bytes():
        out = {}
        for root, _d, names in os.walk(state_dir(e)):
            for n in names:
                with open(os.path.join(root, n), "rb") as f:
                    out[os.path.join(root, n)] = f.read()
        return out
    before = state_bytes()

    assert helpers.occurrences_in_memory(e.proc.pid, old_key) >= 1  # the scan finds a KEK
    r = ctl_ok(e, "keys", "rotate")
    assert "rewrapped" in r.out, r.out
    with open(mk, "rb") as f:
        new_key = f.read()
    assert len(new_key) == 32 and new_key != old_key, "master key file unchanged"
    # The retired KEK unwraps nothing stored any more: its page is wiped and unmapped.
    assert helpers.occurrences_in_memory(e.proc.pid, old_key) == 0, "old KEK left in memory"
    assert helpers.occurrences_in_memory(e.proc.pid, new_key) >= 1
    assert stat.S_IMODE(os.stat(mk).st_mode) == 0o600
    assert not os.path.exists(mk + ".next")
    after = state_bytes()
    assert after != before, "state not rewritten by the rotation"
    expect(not any(contains_any(b, {"v": v}) for b in after.values()), "value in clear at rest")

    # Secrets still inject: the running run (rebuilt or not), a new run, a rotated secret.
    for rr in (run, create_run(e, world, {"org": "acme"},
                               [bearer_pin(api_host(world), "kek_tok")])):
        marker = "m-kek-" + pysecrets.token_hex(3)
        c, resp = get_via(rr, "api.test", world.U, f"/echo/{marker}")
        c.close()
        assert resp.status == 200
        expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"], "not injected after rotate")
    v2 = sval("kek2")
    rotate_secret(e, "kek_tok", v2, org="acme")
    ctl_ok(e, "keys", "rotate")  # twice
    with open(mk, "rb") as f:
        assert f.read() not in (old_key, new_key)

    # After a restart only the current master key exists: everything still decrypts.
    assert e.stop() == 0
    e.start()
    marker = "m-kek-restart-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v2}"],
           "not injected after rotate + restart")


def test_a_deleted_secret_leaves_no_copy_in_memory(factory, world):
    """Once the run that used a secret is revoked and the secret deleted, its value is nowhere
    in egressd's writable memory (heap, arenas, every thread's stack): not in the pin's
    injection, the scrubber's needles, the request's buffers, the dead frames of the threads
    that unsealed it, nor what was read of a response that echoed it (/echo reflects the
    request's headers: the scrubber redacts the copy it relays, and the upstream connection's
    read buffer and OpenSSL's decrypted record, which kept the echo, are wiped)."""
    e = factory.start(mutate=cp_mutate(world))
    v = sval("wipe")
    put_secret(e, "wipe_tok", v, org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(api_host(world), "wipe_tok")])
    marker = "m-wipe-" + pysecrets.token_hex(3)
    c, _resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"], "not injected")
    needle = v[-32:].encode()  # a freed block's first 16 bytes are malloc's: the random tail
    assert helpers.occurrences_in_memory(e.proc.pid, needle) >= 1  # the scan finds a live one
    api_ok(e, "DELETE", f"/v1/runs/{run.id}")
    api_ok(e, "DELETE", "/v1/secrets/wipe_tok")
    left = helpers.occurrences_in_memory(e.proc.pid, needle)
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:  # an idle worker lets go of the old runtime
        time.sleep(0.1)
        left = helpers.occurrences_in_memory(e.proc.pid, needle)
    assert left == 0, f"{left} cop(ies) of a deleted secret left in egressd's memory"


def test_keys_rotate_after_a_reload_that_moved_the_master_key_file_keeps_the_key_in_effect(
        factory, world):
    """keys.master_key_file needs a restart: a reload that changes it leaves the KEK the
    process started with in effect, and `keys rotate` writes its successor at that path. It had
    written the new key to the file's new path (var/other.key) and rewrapped the state under
    it, leaving var/master.key as it was: a restart with the original config then unsealed no
    secret and no run."""
    e = factory.start(mutate=cp_mutate(world))
    v = sval("kekmv")
    put_secret(e, "kekmv_tok", v, org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(api_host(world), "kekmv_tok")])
    mk = master_key_file(e)
    with open(mk, "rb") as f:
        old_key = f.read()
    other = os.path.join(os.path.dirname(mk), "other.key")
    e.rewrite_config(lambda c: c["keys"].__setitem__("master_key_file", other))
    e.reload()
    line = [l for l in e.stderr_text().splitlines() if "needs a restart" in l][-1]
    assert "keys.master_key_file" in line, line

    ctl_ok(e, "keys", "rotate")  # exit 0: nothing skipped
    assert not os.path.exists(other) and not os.path.exists(other + ".next")
    assert not os.path.exists(mk + ".next")
    with open(mk, "rb") as f:
        new_key = f.read()
    assert len(new_key) == 32 and new_key != old_key, "the master key in effect was not rotated"
    marker = "m-kekmv-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    assert resp.status == 200
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"], "not injected after rotate")

    # A restart with the original config (var/master.key) unseals the secret and the run.
    assert e.stop() == 0
    e.start()
    assert "not served" not in e.stderr_text()
    marker = "m-kekmv-restart-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    assert resp.status == 200
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"],
           "not injected after rotate + restart")


def test_a_kms_key_id_that_moved_on_still_unwraps_and_rotates(factory, world):
    """keys.kms_command: after a restart the plugin reports a new key id (its KMS rotated the
    key version) and still unwraps what it wrapped before. Runs and secrets sealed under the
    old id stay served (they go to the KMS), and `keys rotate` rewraps them under the new id;
    a record no key unwraps is logged, naming the run, never dropped silently."""
    kek, kms = kms_stub(world, "kms-moved-")
    with open(kek + ".id", "w") as f:
        f.write("v1\n")
    e = factory.start(mutate=cp_mutate(world, extra=lambda c: c["keys"].update(kms_command=kms)))
    v = sval("kms-moved")
    put_secret(e, "kms_tok", v, org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(api_host(world), "kms_tok")])

    def injected(tag: str) -> bool:
        marker = f"m-kms-{tag}-" + pysecrets.token_hex(3)
        c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
        c.close()
        return resp.status == 200 and seen_auth(world.upstream, marker) == [f"Bearer {v}"]

    assert injected("v1")
    assert e.stop() == 0
    with open(kek + ".id", "w") as f:
        f.write("v2\n")
    e.start()
    assert injected("v2-before-rotate"), "a run sealed under the KMS's earlier key id was dropped"
    r = api(e, "POST", "/v1/keys/rotate", timeout=30)
    assert r.status == 200 and r.json["kek_id"] == "kms:v2" and r.json["rewrapped"] >= 2, r.body
    assert e.stop() == 0
    os.unlink(kek + ".id")  # now a key id nothing was sealed under, and no earlier "kms:" id
    e.start()
    assert injected("fingerprint"), "the KMS unwraps what it wrapped, whatever id it reports"
    # A key id that is no KMS's: a file master key cannot open them; the run is named. Without
    # the key file, a start is refused (a new key would seal new records under a second key).
    assert e.stop() == 0
    e.config["keys"].pop("kms_command")
    stderr = helpers.start_fails(e)
    assert "does not exist, but the state holds records sealed under kms:v2" in stderr, \
        stderr[-1500:]
    key = master_key_file(e)
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    e.start()
    helpers.poll(lambda: f"run {run.id}: not served: no key 'kms:v2'" in e.stderr_text(), 10,
                 "the unserved run logged")
    assert api(e, "GET", f"/v1/runs/{run.id}").status == 200


def test_a_run_seen_at_start_costs_one_kms_unwrap(factory, world):
    """keys.kms_command starts a process per wrap or unwrap: a replica building a run it has
    not seen (at start, or a run another replica made) unwraps the run's CA key once, for its
    record's MAC key and its CA together (it had asked twice)."""
    kek, kms = kms_stub(world, "kms-calls-")
    e = factory.start(mutate=cp_mutate(world, extra=lambda c: c["keys"].update(kms_command=kms)))
    runs = [create_run(e, world, {"org": "acme"}, [], allow=["x.test"]) for _ in range(3)]
    assert e.stop() == 0
    os.unlink(kek + ".calls")
    e.start()
    for run in runs:  # all three are served after the restart
        c, r = helpers.proxy_connect(e.proxy_port, f"unlisted.test:{world.U}", run.auth)
        c.close()
        assert (r.status, r.egress_reason) == (403, "host_not_allowed"), (r.status, r.body)
    with open(kek + ".calls") as f:
        calls = f.read().split()
    assert calls.count("unwrap") == len(runs), calls


def test_keys_rotate_fails_whole_while_the_kms_is_down(factory, world):
    """keys.kms_command and a KMS that fails every wrap and unwrap: `keys rotate` answers
    500 kek_failed naming the key, writes nothing (no record is taken for one no key unwraps:
    that had answered 200 with every record "skipped", and egressctl exited 0); the secret
    is still served meanwhile, and once the KMS is back the rotation goes through."""
    kek, kms = kms_stub(world, "kms-down-")
    e = factory.start(mutate=cp_mutate(world, extra=lambda c: c["keys"].update(kms_command=kms)))
    v = sval("kms-down")
    put_secret(e, "down_tok", v, org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(api_host(world), "down_tok")])
    before = _read_state(e)
    open(kek + ".down", "w").close()
    r = api(e, "POST", "/v1/keys/rotate", timeout=30)
    assert r.status == 500 and r.json["error"] == "kek_failed", (r.status, r.body[:300])
    assert "does not work" in r.json["detail"] and "exited with status 1" in r.json["detail"]
    assert _read_state(e) == before
    r = ctl(e, "keys", "rotate")
    assert r.returncode == 1 and "500" in r.err, (r.returncode, r.err)
    assert _injects(run, world, v, "kms-down")
    os.unlink(kek + ".down")
    r = api(e, "POST", "/v1/keys/rotate", timeout=30)
    assert r.status == 200 and r.json["skipped"] == [] and r.json["rewrapped"] >= 2, r.body


def _state_file(e) -> str:
    return os.path.join(state_dir(e), "state.json")


def _read_state(e) -> dict:
    with open(_state_file(e)) as f:
        return json.load(f)


def _seal_run_ca_key_under(e, run_id: str, kek_id: str):
    """Edits state.json (egressd stopped): the run's CA key names a key id no key has."""
    st = _read_state(e)
    runs = [r for r in st["runs"] if r["id"] == run_id]
    assert len(runs) == 1, run_id
    runs[0]["ca_key"]["kek_id"] = kek_id
    with open(_state_file(e), "w") as f:
        json.dump(st, f)


def _file_key_id(path: str) -> str:
    """A master key file's key id: "file:" + the first 8 hex of SHA-256 of its 32 bytes."""
    import hashlib
    with open(path, "rb") as f:
        return "file:" + hashlib.sha256(f.read()).hexdigest()[:8]


def _injects(run, world, v: str, tag: str) -> bool:
    marker = f"m-{tag}-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    return resp.status == 200 and seen_auth(world.upstream, marker) == [f"Bearer {v}"]


def _runs_ca_key_under(e, *, bad: str, good: str, secret: str) -> tuple[str, str, str]:
    st = _read_state(e)
    runs = {r["id"]: r["ca_key"]["kek_id"] for r in st["runs"]}
    (sec,) = [s["kek_id"] for s in st["secrets"] if s["name"] == secret]
    return runs[bad], runs[good], sec


def _a_good_and_a_bad_run(factory, world, tag: str):
    """egressd with a secret `<tag>_tok` and two runs pinning it, the first of which the
    test then makes unservable (_seal_run_ca_key_under, egressd stopped). Returns (egressd,
    the value, its pins, that run, the other)."""
    e = factory.start(mutate=cp_mutate(world))
    v = sval(tag)
    put_secret(e, f"{tag}_tok", v, org="acme")
    pins = [bearer_pin(api_host(world), f"{tag}_tok")]
    bad = create_run(e, world, {"org": "acme"}, pins)
    good = create_run(e, world, {"org": "acme"}, pins)
    return e, v, pins, bad, good


def test_keys_rotate_skips_a_record_no_key_unwraps(factory, world):
    """A run whose CA key is sealed under a key id no loaded key has (state.json edited to
    `file:00000000`) is not served; `keys rotate` still answers 200, rewraps everything else
    under the new key, names the run in "skipped" (never a value), leaves no
    master.key.next, and egressd restarts with the secret still injected. It had answered
    500 kek_failed, left master.key.next, and every start after failed on it."""
    e, v, pins, bad, good = _a_good_and_a_bad_run(factory, world, "skip")
    mk = master_key_file(e)
    old_id = _file_key_id(mk)
    assert _runs_ca_key_under(e, bad=bad.id, good=good.id, secret="skip_tok") == (old_id,) * 3
    assert e.stop() == 0
    _seal_run_ca_key_under(e, bad.id, "file:00000000")
    e.start()
    helpers.poll(lambda: f"run {bad.id}: not served: no key 'file:00000000'" in e.stderr_text(),
                 10, "the unserved run logged")
    assert _injects(good, world, v, "skip-before")

    r = api(e, "POST", "/v1/keys/rotate", timeout=30)
    assert r.status == 200, r.body
    j = r.json
    new_id = _file_key_id(mk)
    assert j["kek_id"] == new_id != old_id, j
    assert j["rewrapped"] == 2, j  # the secret and the good run's CA key
    assert [(s["kind"], s["name"]) for s in j["skipped"]] == [("run", bad.id)], j
    assert "file:00000000" in j["skipped"][0]["reason"], j
    assert not os.path.exists(mk + ".next"), "master.key.next left behind"
    assert _runs_ca_key_under(e, bad=bad.id, good=good.id, secret="skip_tok") == \
        ("file:00000000", new_id, new_id)
    helpers.poll(lambda: "keys rotate: 1 record(s)" in e.stderr_text(), 10, "the warning")
    assert f"run {bad.id}: no loaded key has id 'file:00000000'" in e.stderr_text()
    assert _injects(good, world, v, "skip-after")

    # egressctl names what was skipped (a second rotation skips the same run), and exits 1:
    # a script that goes on to retire the old key must stop.
    r = ctl(e, "keys", "rotate")
    assert r.returncode == 1, (r.returncode, r.err)
    assert "1 skipped" in r.out and f"run {bad.id}: " in r.out, r.out
    assert "1 record(s) not rewrapped" in r.err, r.err
    assert not os.path.exists(mk + ".next")
    newer_id = _file_key_id(mk)
    assert newer_id not in (old_id, new_id)

    # A restart works (nothing left to finish), the secret still injects, the run stays out.
    assert e.stop() == 0
    e.start()
    assert _runs_ca_key_under(e, bad=bad.id, good=good.id, secret="skip_tok") == \
        ("file:00000000", newer_id, newer_id)
    assert _injects(good, world, v, "skip-restart")
    fresh = create_run(e, world, {"org": "acme"}, pins)
    assert _injects(fresh, world, v, "skip-fresh")
    c, resp = helpers.proxy_connect(bad.proxy_port, api_host(world), bad.auth)
    c.close()
    assert resp.status == 407, resp.status
    expect(not contains_any(e.stderr_text(), {"v": v}), "a secret value in the log")
    expect(not any(contains_any(body, {"v": v}) for _, body in SEEN), "a value in an answer")


def test_interrupted_keys_rotate_finishes_at_start_past_a_record_no_key_unwraps(factory, world):
    """A rotation interrupted after master.key.next was written is finished at the next start;
    a run no key unwraps is skipped (named in a warning) instead of egressd refusing to
    start, at this start and every later one."""
    e, v, _, bad, good = _a_good_and_a_bad_run(factory, world, "skip_start")
    mk = master_key_file(e)
    assert e.stop() == 0
    _seal_run_ca_key_under(e, bad.id, "file:00000000")
    fd = os.open(mk + ".next", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(32))
    os.close(fd)
    next_id = _file_key_id(mk + ".next")
    e.start()
    assert not os.path.exists(mk + ".next"), "the rotation was not finished"
    assert _file_key_id(mk) == next_id
    assert _runs_ca_key_under(e, bad=bad.id, good=good.id, secret="skip_start_tok") == \
        ("file:00000000", next_id, next_id)
    log = e.stderr_text()
    assert f"run {bad.id}: no loaded key has id 'file:00000000'" in log, log[-2000:]
    assert "finishing the rotation interrupted" not in log, log[-2000:]
    assert _injects(good, world, v, "skip-start")
    assert e.stop() == 0
    e.start()
    assert _injects(good, world, v, "skip-start-again")


def test_restart_keeps_secrets_runs_and_ca(factory, world):
    e = factory.start(mutate=cp_mutate(world))
    v = sval("restart")
    put_secret(e, "rs_tok", v, org="acme", project="web")
    run = create_run(e, world, {"org": "acme", "project": "web"},
                     [bearer_pin(api_host(world), "rs_tok")], allow=["tunnel.test"])
    revoked = create_run(e, world, {"org": "acme", "project": "web"},
                         [bearer_pin(api_host(world), "rs_tok")])
    api_ok(e, "DELETE", f"/v1/runs/{revoked.id}")
    secrets_before = api_ok(e, "GET", "/v1/secrets")
    show_before = api_ok(e, "GET", f"/v1/runs/{run.id}")

    assert e.stop() == 0
    e.start()

    assert api_ok(e, "GET", "/v1/secrets") == secrets_before
    show_after = api_ok(e, "GET", f"/v1/runs/{run.id}")
    assert show_after == show_before
    assert show_after["ca_pem"] == run.reply["ca_pem"], "run CA changed across the restart"
    # The old CA file (what the sandbox has) still verifies the leaf minted after the restart,
    # and the proxy token from before the restart still works.
    marker = "m-restart-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    assert resp.status == 200
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"], "not injected after restart")
    # revocation survived too
    c, resp = helpers.proxy_connect(revoked.proxy_port, api_host(world), revoked.auth)
    c.close()
    assert (resp.status, resp.egress_reason) == (403, "run_revoked"), resp.status
    # the admin token did not change
    assert api(e, "GET", "/v1/secrets").status == 200


def test_a_missing_master_key_with_sealed_state_is_a_start_error(factory, world):
    """A master key file gone (a volume not mounted, a wrong path) while the state holds
    records sealed under it: egressd had made a new key and served, every secret and run
    unreadable and new writes sealed under a second key. Now the start fails naming the key
    file and the key the records need; with the file back, everything serves as before."""
    e = factory.start(mutate=cp_mutate(world))
    put_secret(e, "mk_tok", sval("mk"), org="acme")
    secrets_before = api_ok(e, "GET", "/v1/secrets")
    key = master_key_file(e)
    with open(key, "rb") as f:
        key_bytes = f.read()
    assert e.stop() == 0
    os.rename(key, key + ".away")
    stderr = helpers.start_fails(e)
    assert "keys.master_key_file: " + key + " does not exist" in stderr, stderr[-1500:]
    assert "file:" in stderr.split("sealed under", 1)[1], stderr[-1500:]
    assert not os.path.exists(key), "a new master key was made"
    os.rename(key + ".away", key)
    e.start()
    with open(key, "rb") as f:
        assert f.read() == key_bytes
    assert api_ok(e, "GET", "/v1/secrets") == secrets_before
    # A state with nothing sealed still gets its key made on first start.
    fresh = factory.start(mutate=cp_mutate(world))
    assert os.path.getsize(master_key_file(fresh)) > 0


def test_crash_during_writes_keeps_every_acknowledged_write(factory, world):
    """Three writers stream `egressctl secret put`; egressd is SIGKILLed while writes are in
    flight, twice. After each restart every acknowledged write is there, each writer's writes
    form a prefix of its stream (no holes), and every stored secret decrypts to its value."""
    e = factory.start(mutate=cp_mutate(world))
    streams = [[f"crash-{w_}-{i:03d}" for i in range(40)] for w_ in range(3)]
    values = {n: sval(f"c{n[6:]}") for seq in streams for n in seq}
    for n, v in values.items():
        e.secrets[f"cp:{n}"] = v
    acked: set[str] = set()
    lock = threading.Lock()
    listed: dict = {}

    for cycle in range(2):
        stop = threading.Event()

        def writer(seq):
            for name in seq:
                if stop.is_set():
                    return
                if name in listed:  # written before the previous crash
                    continue
                r = ctl(e, "secret", "put", name, "--scope", "org=acme", stdin=values[name],
                        timeout=15)
                if r.returncode == 0:
                    with lock:
                        acked.add(name)

        goal = len(acked) + 15
        threads = [threading.Thread(target=writer, args=(seq,), daemon=True) for seq in streams]
        for t in threads:
            t.start()
        helpers.poll(lambda: len(acked) >= goal, 60.0, f"{goal} acknowledged writes",
                     interval=0.002)
        e.kill()  # SIGKILL with writes in flight
        assert e.proc.returncode == -9
        stop.set()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive()
        with lock:
            acked_before_kill = set(acked)  # every write whose 201 arrived before the kill
        assert len(acked_before_kill) < len(values), "the streams ended before the kill"

        e.start()
        listed = {s["name"]: s for s in api_ok(e, "GET", "/v1/secrets")["secrets"]}
        missing = sorted(acked_before_kill - set(listed))
        assert not missing, f"cycle {cycle}: acknowledged writes lost: {missing}"
        assert set(listed) <= set(values)
        assert all(s["version"] == 1 for s in listed.values())
        for seq in streams:
            present = [n for n in seq if n in listed]
            assert present == seq[:len(present)], f"cycle {cycle}: a hole in {present}"

    # Every secret in the store decrypts to exactly its value.
    for name in sorted(listed):
        run = create_run(e, world, {"org": "acme"}, [bearer_pin(api_host(world), name)])
        marker = f"m-{name}-" + pysecrets.token_hex(2)
        c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
        c.close()
        assert resp.status == 200, (name, resp.status)
        expect(seen_auth(world.upstream, marker) == [f"Bearer {values[name]}"],
               f"{name}: wrong value after crash + restart")
    # still writable afterwards
    put_secret(e, "after-crash", sval("after"), org="acme")


# ---------------------------------------------------------------------------------------------
# the sandbox's view: a fresh shell with an empty environment


@pytest.fixture(scope="module")
def git_world(world):
    root = world.new_dir("git-")
    content = make_bare_repo(root)
    cert, key = make_leaf(world.pki.dir, "gittest", ["git.test"])
    token = "ghp_itest_" + pysecrets.token_hex(16)
    srv = GitServer(root, cert, key, token)
    yield srv, content
    srv.close()


def test_e2e_empty_env_shell_curl_requests_git(factory, world, git_world, tmp_path):
    git, content = git_world
    token = git.token
    # The git server really requires the token: without it, 401.
    ctx = ssl.create_default_context(cafile=world.pki.ca)
    ctx.check_hostname = False
    req = urllib.request.Request(f"https://127.0.0.1:{git.port}/repo.git/info/refs"
                                 "?service=git-upload-pack")
    # The probe goes straight to the Python test server; on a loaded CI machine its handler
    # thread has been seen to drop the first connection, so retry (bounded).
    for attempt in range(3):
        try:
            urllib.request.urlopen(req, context=ctx, timeout=10)
            raise AssertionError("git server answered without a token")
        except urllib.error.HTTPError as ex:
            assert ex.code == 401
            break
        except (ConnectionError, http.client.RemoteDisconnected):
            if attempt == 2:
                raise
    with git.lock:
        oks = [ok for _m, _p, ok in git.log]
        assert oks and not any(oks)
        git.log.clear()

    e = factory.start(mutate=cp_mutate(world, {"git.test": ["127.0.0.1"]}, [git.port]))
    put_secret(e, "git_token", token, org="acme", project="web")

    sandbox = tmp_path / "sandbox"
    sandbox.mkdir()
    m_curl = "m-e2e-curl-" + pysecrets.token_hex(3)
    m_req = "m-e2e-requests-" + pysecrets.token_hex(3)
    U = world.U
    ctl_cmd = " ".join(shlex.quote(a) for a in [
        egressctl_bin(), "--admin", f"http://127.0.0.1:{e.admin_port}",
        "--token-file", e.config["admin"]["token_file"],
        "run", "create", "--scope", "org=acme", "--scope", "project=web", "--scope", "user=ana",
        "--pin", f"api.test:{U}=git_token:bearer",
        "--pin", f"git.test:{git.port}=git_token:bearer",
        "--ttl", "10m", "--env"])
    script = f"""
set -e
cd {shlex.quote(str(sandbox))}
envlines="$({ctl_cmd})"
eval "$envlines"
curl -sS -f --max-time 30 https://api.test:{U}/echo/{m_curl} -o curl.out
/usr/bin/python3 -c "
import requests, sys
r = requests.get('https://api.test:{U}/echo/{m_req}', timeout=30)
r.raise_for_status()
open('requests.out', 'wb').write(r.content)
"
git -c protocol.version=2 clone -q https://git.test:{git.port}/repo.git clone
env > env.dump
echo done
"""
    r = subprocess.run(["env", "-i", "bash", "--noprofile", "--norc", "-c", script],
                       capture_output=True, timeout=180, stdin=subprocess.DEVNULL,
                       start_new_session=True)
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    expect(token not in out and token not in err, "the token appeared in the shell's output")
    assert r.returncode == 0 and out.strip().endswith("done"), (r.returncode, out[-2000:],
                                                                 err[-3000:])

    # Everything got the token, injected by egressd.
    expect(seen_auth(world.upstream, m_curl) == [f"Bearer {token}"], "curl: token not injected")
    expect(seen_auth(world.upstream, m_req) == [f"Bearer {token}"],
           "requests: token not injected")
    with git.lock:
        log = list(git.log)
    assert log and all(ok for _m, _p, ok in log), f"git server saw unauthorized requests: {log}"
    assert any("git-upload-pack" in p for _m, p, _ok in log)
    with open(sandbox / "clone" / "README.md") as f:
        assert f.read() == content

    # Nothing in the sandbox's environment or files holds the token.
    with open(sandbox / "env.dump") as f:
        env_text = f.read()
    env = dict(ln.split("=", 1) for ln in env_text.splitlines() if "=" in ln)
    for k in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
              "NODE_EXTRA_CA_CERTS", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE", "https_proxy",
              "http_proxy", "no_proxy"):
        assert k in env, k
    # The variables that replace a client's trust store name the bundle (system roots + the
    # run CA); NODE_EXTRA_CA_CERTS (additive) the run CA alone.
    for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "GIT_SSL_CAINFO", "CURL_CA_BUNDLE"):
        assert env[k] == str(sandbox / "egress-run-ca-bundle.pem"), k
    assert env["NODE_EXTRA_CA_CERTS"] == str(sandbox / "egress-run-ca.pem")
    expect(not contains_any(env_text, {"t": token}), "token in the sandbox environment")
    hits = []
    for root, _dirs, names in os.walk(sandbox):
        for n in names:
            p = os.path.join(root, n)
            if os.path.islink(p):
                continue
            with open(p, "rb") as f:
                if contains_any(f.read(), {"t": token}):
                    hits.append(os.path.relpath(p, sandbox))
    expect(not hits, f"token found in sandbox files: {hits}")
    with open(sandbox / "clone" / ".git" / "config") as f:
        gc = f.read()
    assert f"https://git.test:{git.port}/repo.git" in gc
    with open(sandbox / "egress-run-ca.pem") as f:
        assert f.read().startswith("-----BEGIN CERTIFICATE-----")
    # responses that echoed the token were scrubbed before the sandbox saw them
    for name in ("curl.out", "requests.out"):
        assert (sandbox / name).stat().st_size > 0

    # After revocation the same environment gets nothing.
    run_id = env["HTTPS_PROXY"].split("//")[1].split(":")[0]
    api_ok(e, "DELETE", f"/v1/runs/{run_id}")
    r2 = helpers.curl([f"https://api.test:{U}/echo/{m_curl}-revoked"], env=env, timeout=20)
    assert r2.returncode != 0
    assert not world.upstream.find(f"{m_curl}-revoked")


def test_run_ca_is_name_constrained_to_the_runs_hosts(cp, world, api_secret):
    """A run created with its hosts gets a CA that can certify only them (issue 6 item 3):
    openssl shows the constraint, a pin outside it is refused, one inside is accepted."""
    run = create_run(cp, world, {"org": "acme"}, [bearer_pin(api_host(world), "api_tok")],
                     allow=["*.s3.test"])
    text = subprocess.run(["openssl", "x509", "-noout", "-text", "-in", run.ca_file],
                          capture_output=True, text=True, check=True).stdout
    assert "X509v3 Name Constraints: critical" in text
    assert "DNS:api.test" in text and "DNS:.s3.test" in text
    r = api(cp, "POST", f"/v1/runs/{run.id}/pins", bearer_pin("evil.test", "api_tok"))
    assert r.status == 409 and b"name constraints" in r.body
    api_ok(cp, "POST", f"/v1/runs/{run.id}/pins", bearer_pin("b.s3.test", "api_tok"))
    # and the constrained CA still serves its pinned host end to end
    marker = "m-nc-" + pysecrets.token_hex(3)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    assert resp.status == 200


def test_admin_max_runs_and_max_pins_per_run_bound_the_store(factory, world):
    """admin.max_runs counts every run in the store (a revoked one until it expires) and
    admin.max_pins_per_run the pins of one: over them, 409 (400 for a creation asking for
    more pins at once), the detail naming the key; below them everything works."""
    def limits(c):
        cp_mutate(world)(c)
        c["admin"].update(max_runs=2, max_pins_per_run=2)
    e = factory.start(mutate=limits)
    put_secret(e, "lim_tok", sval("lim"), org="acme")
    pin = bearer_pin(api_host(world), "lim_tok")
    r = api(e, "POST", "/v1/runs", {"scope": {"org": "acme"}, "pins": [pin, pin, pin]})
    assert r.status == 400 and "admin.max_pins_per_run (2)" in r.json["detail"], r.body
    # A run's allow list and source ranges are bounded the same way (they were not: 75 000
    # hosts fit in a 1 MiB body, each a name constraint of its CA).
    for field, values in (("allow_hosts", ["a.test", "b.test", "c.test"]),
                          ("source_cidrs", ["10.9.0.1/32", "10.9.0.2/32", "10.9.0.3/32"])):
        r = api(e, "POST", "/v1/runs", {"scope": {"org": "acme"}, "pins": [pin], field: values})
        assert r.status == 400 and r.json["detail"].startswith(field), r.body
        assert "admin.max_pins_per_run (2)" in r.json["detail"], r.body
    one = create_run(e, world, {"org": "acme"}, [pin, pin])
    r = api(e, "POST", f"/v1/runs/{one.id}/pins", pin)
    assert r.status == 409 and "admin.max_pins_per_run (2)" in r.json["detail"], r.body
    two = create_run(e, world, {"org": "acme"}, [pin])
    api_ok(e, "POST", f"/v1/runs/{two.id}/pins", pin)
    api_ok(e, "DELETE", f"/v1/runs/{two.id}")
    r = api(e, "POST", "/v1/runs", {"scope": {"org": "acme"}, "pins": [pin]})
    assert r.status == 409 and "admin.max_runs (2)" in r.json["detail"], r.body
    marker = "m-lim-" + pysecrets.token_hex(3)
    c, resp = get_via(one, "api.test", world.U, f"/echo/{marker}")
    c.close()
    assert resp.status == 200


def test_a_pin_added_later_is_checked_against_the_run_cas_own_constraints(factory, world):
    """The names a run's CA permits were fixed when it was made: a reload that changes what a
    new run would get (policy.unpinned: intercept adds the global allow list) changes nothing
    for it. A pin added afterwards is judged by the CA's constraints as the CA carries them:
    refused if the CA cannot certify it (it had been accepted, and then failed every TLS
    handshake), accepted if it can (it had been refused)."""
    def policy_mode(mode: str):
        def mutate(c):
            c["policy"]["unpinned"] = mode
        return mutate
    e = factory.start(mutate=lambda c: (cp_mutate(world)(c), policy_mode("tunnel")(c)))
    put_secret(e, "nc_tok", sval("nc"), org="acme")
    made_under_tunnel = create_run(e, world, {"org": "acme"},
                                   [bearer_pin(api_host(world), "nc_tok")])
    e.config["policy"]["unpinned"] = "intercept"
    e.write_config()
    e.reload()
    made_under_intercept = create_run(e, world, {"org": "acme"},
                                      [bearer_pin(api_host(world), "nc_tok")])
    # tunnel.test is in the global allow list: only the CA made under intercept permits it.
    r = api(e, "POST", f"/v1/runs/{made_under_tunnel.id}/pins", bearer_pin("tunnel.test", "nc_tok"))
    assert r.status == 409 and b"name constraints" in r.body, (r.status, r.body[:300])
    e.config["policy"]["unpinned"] = "tunnel"
    e.write_config()
    e.reload()
    api_ok(e, "POST", f"/v1/runs/{made_under_intercept.id}/pins",
           bearer_pin("tunnel.test", "nc_tok"))


# ---------------------------------------------------------------------------------------------
# secret values in egressd's memory; admin requests it cannot read


def _raw_admin(e, head: str, body: bytes = b"", timeout: float = 10.0) -> helpers.Response:
    """Sends one request as written (head and body in separate writes) on a fresh connection."""
    s = socket.create_connection(("127.0.0.1", e.admin_port), timeout=timeout)
    c = helpers.Conn(s)
    try:
        c.send(head.encode())
        if body:
            c.send(body)
        return helpers.read_response(c)
    finally:
        c.close()


def _chunked(body: bytes, size: int = 7) -> bytes:
    out = b"".join(f"{len(body[i:i + size]):x}\r\n".encode() + body[i:i + size] + b"\r\n"
                   for i in range(0, len(body), size))
    return out + b"0\r\n\r\n"


@pytest.mark.parametrize("framing", ["content_length", "chunked", "syntax_error_after_value",
                                     "value_given_twice"])
def test_admin_request_leaves_no_copy_of_a_secret_value(cp, framing):
    """A secret no run uses is never unsealed: once its POST is answered, egressd's memory holds
    no copy of the value, whatever the framing: not the raw bytes read, not a body copy left by
    growing (chunked), not what the JSON parser freed on an error or for a key given twice."""
    v = sval("mem")
    name = "mem_" + pysecrets.token_hex(4)
    body = json.dumps({"name": name, "scope": {"org": "acme"}, "value": v}).encode()
    want_status = 201
    if framing == "syntax_error_after_value":
        body = body[:-1] + b", }"
        want_status = 400
    elif framing == "value_given_twice":
        body = body[:-1] + b', "value": "' + sval("mem2").encode() + b'"}'
        want_status = 400
    head = (f"POST /v1/secrets HTTP/1.1\r\nHost: 127.0.0.1:{cp.admin_port}\r\n"
            f"Authorization: Bearer {admin_token(cp)}\r\nContent-Type: application/json\r\n")
    if framing == "chunked":
        resp = _raw_admin(cp, head + "Transfer-Encoding: chunked\r\n\r\n", _chunked(body))
    else:
        resp = _raw_admin(cp, head + f"Content-Length: {len(body)}\r\n\r\n", body)
    SEEN.append(("POST /v1/secrets", resp.body))
    assert resp.status == want_status, (resp.status, resp.body[:300])
    n = helpers.copies_in_memory(cp.proc.pid, v, lambda n: n == 0)
    assert n == 0, f"{n} copies of a secret value no run uses left in egressd's memory"


def test_a_new_runs_token_and_the_admin_token_leave_no_copy_in_memory(cp, world):
    """A run's proxy token is answered once (in proxy_url) and kept only as its SHA-256: after
    the answer no copy is left in egressd's memory (the JSON, the URL, the serialized body
    and the written response are zeroed). The admin token is kept once, however many
    requests carried it (their Authorization fields are parsed into wiping storage)."""
    tokens = []
    for _ in range(3):
        r = api(cp, "POST", "/v1/runs", {"scope": {"org": "acme"}, "pins": []})
        assert r.status == 201, r.body[:300]
        url = r.json["proxy_url"]
        tokens.append(helpers.secret(url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]))
    for t in tokens:
        n = helpers.copies_in_memory(cp.proc.pid, t, lambda n: n == 0)
        assert n == 0, f"{n} copies of a run's proxy token left in egressd's memory"
    for _ in range(20):
        assert api(cp, "GET", "/v1/secrets").status == 200
    n = helpers.copies_in_memory(cp.proc.pid, admin_token(cp), lambda n: n == 1)
    assert n == 1, f"the admin token is in egressd's memory {n} times"


def test_deleted_or_rotated_secret_leaves_memory(cp, world):
    """A value stays unsealed in memory only while a live run's pin uses it: rotating the
    secret drops the old version, revoking the run and deleting the secret drops the new."""
    v1, v2 = sval("rot1"), sval("rot2")
    name = "gone_" + pysecrets.token_hex(4)
    put_secret(cp, name, v1, org="acme")
    run = create_run(cp, world, {"org": "acme"}, [bearer_pin(api_host(world), name)])
    # the pin's value: the scan finds it
    assert helpers.copies_in_memory(cp.proc.pid, v1, lambda n: n >= 1) >= 1
    rotate_secret(cp, name, v2, org="acme")
    assert helpers.copies_in_memory(cp.proc.pid, v2, lambda n: n >= 1) >= 1
    n = helpers.copies_in_memory(cp.proc.pid, v1, lambda n: n == 0)
    assert n == 0, f"{n} copies of a rotated-away version left in egressd's memory"
    api_ok(cp, "DELETE", f"/v1/runs/{run.id}")
    assert api(cp, "DELETE", f"/v1/secrets/{name}").status == 204
    n = helpers.copies_in_memory(cp.proc.pid, v2, lambda n: n == 0)
    assert n == 0, f"{n} copies of a deleted secret left in egressd's memory"


def test_connections_left_open_do_not_keep_a_rotated_value(cp, world, marker):
    """Connections of a run that stay open across a rotation of its secret do not keep the old
    value in memory: a blind tunnel (once its bytes flow), an HTTP/1.1 keep-alive connection
    after its next request, an HTTP/2 connection between streams. The build before kept it as
    long as any of them was open (each connection held the Run it was admitted under). The
    upstream answers /bytes, not /echo: an echoed credential is in the response bytes egressd
    read, which are not wiped (README)."""
    import types
    from h2_helpers import H2Client
    v1, v2 = sval("open1"), sval("open2")
    name = "open_" + pysecrets.token_hex(4)
    put_secret(cp, name, v1, org="acme")
    run = create_run(cp, world, {"org": "acme"}, [bearer_pin(api_host(world), name)])
    host = api_host(world)
    t, r = helpers.proxy_connect(cp.proxy_port, f"tunnel.test:{world.U}", run.auth)
    assert r.status == 200, (r.status, r.egress_reason)
    t = helpers.tls_wrap(t, "tunnel.test", world.pki.ca)  # end to end: egressd sees no TLS
    h1 = run.tunnel("api.test", world.U)
    h2c = H2Client(cp, types.SimpleNamespace(auth=lambda _run: run.auth), "api.test", world.U,
                   ca=run.ca_file)
    try:
        assert helpers.request(t, "GET", f"/bytes/64?{marker}-t1", f"tunnel.test:{world.U}").status == 200
        tunnel_used = time.monotonic()  # the connection used longest ago
        assert helpers.request(h1, "GET", f"/bytes/64?{marker}-a1", host).status == 200
        assert h2c.request(f"/bytes/64?{marker}-b1")["status"] == 200
        expect(seen_auth(world.upstream, f"{marker}-a1") == [f"Bearer {v1}"], "v1 injected")
        assert helpers.copies_in_memory(cp.proc.pid, v1, lambda n: n >= 1) >= 1
        rotate_secret(cp, name, v2, org="acme")
        assert helpers.request(h1, "GET", f"/bytes/64?{marker}-a2", host).status == 200
        assert h2c.request(f"/bytes/64?{marker}-b2")["status"] == 200
        expect(seen_auth(world.upstream, f"{marker}-a2") == [f"Bearer {v2}"], "h1: v2 injected")
        expect(seen_auth(world.upstream, f"{marker}-b2") == [f"Bearer {v2}"], "h2: v2 injected")
        n = helpers.copies_in_memory(cp.proc.pid, v1, lambda n: n == 0)
        assert n == 0, f"{n} copies of the rotated-away value left while connections stay open"
        if time.monotonic() - tunnel_used > 25:
            # The test upstream closes a connection idle for 30 s, and egressd then closes the
            # tunnel: past that the connections may have closed before the scan ended.
            pytest.skip("the memory scan took over 25 s (a sanitizer's build): cannot show the "
                        "connections were still open when it found no copy")
        # All three are still open and serve.
        assert helpers.request(t, "GET", f"/bytes/64?{marker}-t2", f"tunnel.test:{world.U}").status == 200
        assert helpers.request(h1, "GET", f"/bytes/64?{marker}-a3", host).status == 200
        assert h2c.request(f"/bytes/64?{marker}-b3")["status"] == 200
    finally:
        t.close()
        h1.close()
        h2c.close()
    assert cp.wait_audit(lambda a: a.get("reason") == "tunnel" and a.get("run") == run.id
                         and a.get("host") == "tunnel.test")


@pytest.mark.parametrize("case", ["body_over_limit", "head_over_limit", "malformed"])
def test_unreadable_admin_request_gets_a_json_error(cp, case):
    """A request over the size limits or malformed is answered with a JSON error and the
    connection closed, not reset: the client (egressctl) can tell what went wrong."""
    head = (f"POST /v1/secrets HTTP/1.1\r\nHost: 127.0.0.1:{cp.admin_port}\r\n"
            f"Authorization: Bearer {admin_token(cp)}\r\nContent-Type: application/json\r\n")
    body = b""
    if case == "body_over_limit":
        head += f"Content-Length: {2 << 20}\r\n\r\n"
        body = b"x" * (256 << 10)  # part of it: the client is still sending when refused
        want = (413, "too_large")
    elif case == "head_over_limit":
        head += "X-Pad: " + "a" * (20 << 10) + "\r\nContent-Length: 0\r\n\r\n"
        want = (431, "too_large")
    else:
        head += "Content-Length: twelve\r\n\r\n"
        want = (400, "bad_request")
    resp = _raw_admin(cp, head, body)
    assert resp.status == want[0], (resp.status, resp.body[:300])
    assert resp.header("Content-Type") == "application/json"
    assert (resp.header("Connection") or "").lower() == "close"
    j = json.loads(resp.body)
    assert set(j) == {"error", "detail"} and j["error"] == want[1], j
    assert api(cp, "GET", "/v1/secrets").status == 200  # and egressd serves on


def _admin_limits(**kw):
    return lambda c: c.setdefault("admin", {}).update(kw)


def test_admin_size_limits_are_config_keys_and_reload(factory, world):
    """admin.max_body_bytes and admin.max_header_bytes bound what the admin API reads (413 and
    431 naming the key); under them requests are served, and a reload applies new values to
    the next request on the same listener."""
    e = factory.start(mutate=cp_mutate(world, extra=_admin_limits(max_body_bytes=4096,
                                                                  max_header_bytes=2048)))
    head = (f"POST /v1/secrets HTTP/1.1\r\nHost: 127.0.0.1:{e.admin_port}\r\n"
            f"Authorization: Bearer {admin_token(e)}\r\nContent-Type: application/json\r\n")

    def post(value: str, pad: int = 0) -> helpers.Response:
        body = json.dumps({"name": "lim_" + pysecrets.token_hex(4), "scope": {"org": "acme"},
                           "value": value}).encode()
        extra = f"X-Pad: {'a' * pad}\r\n" if pad else ""
        return _raw_admin(e, head + extra + f"Content-Length: {len(body)}\r\n\r\n", body)

    big, small = sval("b" * 5000), sval("s" * 2000)
    e.secrets["admin-limits-big"], e.secrets["admin-limits-small"] = big, small  # never written
    r = post(big)
    assert r.status == 413, (r.status, r.body[:300])
    j = json.loads(r.body)
    assert j["error"] == "too_large" and "4096 bytes (admin.max_body_bytes)" in j["detail"], j
    r = post(small, pad=3000)
    assert r.status == 431, (r.status, r.body[:300])
    assert "2048 bytes (admin.max_header_bytes)" in json.loads(r.body)["detail"]
    assert post(small, pad=1000).status == 201
    e.rewrite_config(lambda c: c["admin"].__setitem__("max_body_bytes", 65536))
    e.reload()
    assert post(big).status == 201


def test_admin_read_and_write_timeouts_are_config_keys(factory, world):
    """admin.read_timeout closes a connection whose request does not arrive in time (a half
    head, or an idle keep-alive connection); admin.write_timeout one that does not read its
    answers (it was the read's 30 s before). The API keeps answering other clients."""
    e = factory.start(mutate=cp_mutate(world, extra=_admin_limits(read_timeout="1s",
                                                                  write_timeout="500ms")))
    host = f"Host: 127.0.0.1:{e.admin_port}\r\n"
    for first in (b"GET /healthz HTTP/1.1\r\n",  # half a head, then nothing
                  f"GET /healthz HTTP/1.1\r\n{host}\r\n".encode()):  # answered, then idle
        s = socket.create_connection(("127.0.0.1", e.admin_port), timeout=10)
        started = time.monotonic()
        s.sendall(first)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        waited = time.monotonic() - started
        s.close()
        assert 0.5 < waited < 5, (first, waited)
        assert got in (b"",) or got.startswith(b"HTTP/1.1 200"), got[:100]
    took = helpers.send_unread_until_cut(
        e.admin_port, f"GET /metrics HTTP/1.1\r\n{host}\r\n".encode(), limit=20000)
    assert took is not None, "the admin API kept a client that does not read its answers"
    assert took < 3.0, took  # ~0.5 s from the stall
    assert api(e, "GET", "/v1/secrets").status == 200


def test_admin_max_connections_bounds_the_admin_listener(factory, world):
    """admin.max_connections bounds the admin listener's open connections (a sidecar's is
    reachable from the pod): a new connection over it closes the least recently active one that
    is not inside an authorized API call (one that never sent a request, an idle keep-alive
    one), so probes and egressctl still get in. A call in progress is never cut to make room,
    and at most max_connections - 1 are in progress: the call that would take the last place is
    answered 503 naming the key, so a probe always finds a connection to close."""
    e = factory.start(mutate=cp_mutate(world, extra=_admin_limits(max_connections=3)))
    port = e.admin_port
    host = f"Host: 127.0.0.1:{port}\r\n"

    def connect() -> helpers.Conn:
        return helpers.Conn(socket.create_connection(("127.0.0.1", port), timeout=10))

    def healthz(c: helpers.Conn) -> int:
        c.send(f"GET /healthz HTTP/1.1\r\n{host}\r\n".encode())
        return helpers.read_response(c).status

    def closed(c: helpers.Conn) -> bool:
        return helpers.poll(lambda: helpers.closed_by_peer(c), 5, "the connection closed")

    idle = [connect() for _ in range(3)]  # never send anything
    d = connect()
    assert healthz(d) == 200
    assert closed(idle[0])
    assert not helpers.closed_by_peer(idle[1]) and not helpers.closed_by_peer(idle[2])
    assert healthz(d) == 200  # d is now the most recently active
    f = connect()
    assert healthz(f) == 200
    assert closed(idle[1])  # not d, which is older but was active since
    assert not helpers.closed_by_peer(d) and not helpers.closed_by_peer(idle[2])

    # Authorized calls whose bodies are still to come: each new connection makes room by
    # closing an idle one, then its head puts it inside a call.
    bodies, calls = [], []
    for i in range(3):
        value = sval(f"conn{i}")
        bodies.append(json.dumps({"name": f"conn_{i}_{pysecrets.token_hex(3)}",
                                  "scope": {"org": "acme"}, "value": value}).encode())
        a = connect()
        a.send((f"POST /v1/secrets HTTP/1.1\r\n{host}Authorization: Bearer {admin_token(e)}"
                f"\r\nContent-Type: application/json\r\nContent-Length: {len(bodies[i])}"
                "\r\n\r\n").encode())
        calls.append(a)
        time.sleep(0.3)  # its head read before the next connection comes
    for c in (idle[2], d, f):
        assert closed(c)
    full = helpers.read_response(calls[2])  # the third call at once: the last place is kept
    assert full.status == 503, (full.status, full.body[:200])
    assert (full.header("Connection") or "").lower() == "close"
    j = json.loads(full.body)
    assert j["error"] == "too_many_connections", j
    assert "admin.max_connections (3)" in j["detail"], j
    g = connect()
    assert healthz(g) == 200  # a probe still gets in
    assert not helpers.closed_by_peer(calls[0]) and not helpers.closed_by_peer(calls[1])

    # An answered call's connection is closable again; the one in progress is not cut.
    calls[0].send(bodies[0])
    assert helpers.read_response(calls[0]).status == 201
    h = connect()
    assert healthz(h) == 200
    assert closed(g)  # the least recently active one not inside a call
    assert not helpers.closed_by_peer(calls[0]) and not helpers.closed_by_peer(calls[1])
    calls[1].send(bodies[1])
    assert helpers.read_response(calls[1]).status == 201
    names = {s["name"] for s in api_ok(e, "GET", "/v1/secrets")["secrets"]}
    created = {json.loads(b)["name"] for b in bodies}
    assert names & created == created - {json.loads(bodies[2])["name"]}
    assert "admin.max_connections (3) reached" in e.stderr_text()


def test_leftover_temp_files_do_not_block_the_first_start(factory, world):
    """The admin token and master key are written to an unnamed file, then linked into place;
    `<file>.tmp`, what an interrupted create of an older egressd left, does not block a start
    and is removed."""
    e = factory.make(cp_mutate(world))
    var = os.path.dirname(e.config["admin"]["token_file"])
    os.makedirs(var, exist_ok=True)
    for path in (e.config["admin"]["token_file"], master_key_file(e)):
        open(path + ".tmp", "wb").close()
    factory.started.append(e)
    e.start()
    assert len(admin_token(e)) == 64
    assert os.path.getsize(master_key_file(e)) == 32
    for path in (e.config["admin"]["token_file"], master_key_file(e)):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert not os.path.exists(path + ".tmp")
    open(master_key_file(e) + ".next.tmp", "wb").close()
    ctl_ok(e, "keys", "rotate")
    assert not os.path.exists(master_key_file(e) + ".next.tmp")
    assert api(e, "GET", "/v1/secrets").status == 200


# ---------------------------------------------------------------------------------------------
# proxy_url (listen.advertise), run explain of a missing secret, the CA bundle of --env


def _parse_exports(text: str) -> dict:
    exported = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        assert line.startswith("export "), line
        k, _, v = line[len("export "):].partition("=")
        exported[k] = shlex.split(v)[0]
    return exported


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("bind,want_host", [
    ("0.0.0.0", "127.0.0.1"),
    pytest.param("[::]", "::1", marks=pytest.mark.skipif(not _has_ipv6_loopback(),
                                                         reason="no IPv6 loopback")),
    ("127.0.0.1", "127.0.0.1"),
])
def test_proxy_url_of_a_new_run_is_usable(factory, world, bind, want_host):
    """A run's proxy_url names loopback for an unspecified bind, bracketed only when IPv6: a
    `[::]:PORT` listener had given `http://run:TOKEN@[127.0.0.1]:PORT`, which no client
    parses. curl goes through the URL as given, and the pinned credential is injected."""
    def mutate(cfg):
        cp_mutate(world)(cfg)
        cfg["listen"]["proxy"] = f"{bind}:{cfg['listen']['proxy'].rsplit(':', 1)[1]}"
    e = factory.start(mutate=mutate)
    v = sval("url")
    put_secret(e, "url_tok", v, org="acme")
    r = api(e, "POST", "/v1/runs", {"scope": {"org": "acme"},
                                    "pins": [bearer_pin(api_host(world), "url_tok")]})
    assert r.status == 201, r.status
    j = r.json
    u = urllib.parse.urlsplit(j["proxy_url"])
    assert (u.scheme, u.hostname, u.port, u.username) == ("http", want_host, e.proxy_port,
                                                          j["id"])
    ca = os.path.join(e.workdir, f"{j['id']}-url-ca.pem")
    with open(ca, "w") as f:
        f.write(j["ca_pem"])
    marker = "m-url-" + pysecrets.token_hex(3)
    c = helpers.curl(["-x", j["proxy_url"], "--cacert", ca, "-o", "/dev/null", "-w",
                      "%{http_code}", f"https://{api_host(world)}/echo/{marker}"], timeout=30)
    assert c.returncode == 0 and c.stdout == b"200", (c.returncode, c.stderr[-500:])
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"], "token not injected")


def test_listen_advertise_names_the_proxy_url_and_follows_a_reload(factory, world):
    """listen.advertise is what a new run's proxy_url names (a Service name in a cluster); a
    reload applies a new value to runs created after it."""
    def mutate(cfg):
        cp_mutate(world)(cfg)
        cfg["listen"]["proxy"] = f"0.0.0.0:{cfg['listen']['proxy'].rsplit(':', 1)[1]}"
        cfg["listen"]["advertise"] = "egressd-gateway.ns.svc.cluster.local:3128"
    e = factory.start(mutate=mutate)

    def url_of_new_run():
        r = api(e, "POST", "/v1/runs", {"scope": {"org": "acme"}, "allow_hosts": ["x.test"]})
        assert r.status == 201, r.status
        return urllib.parse.urlsplit(r.json["proxy_url"])

    u = url_of_new_run()
    assert (u.hostname, u.port) == ("egressd-gateway.ns.svc.cluster.local", 3128)
    e.config["listen"]["advertise"] = "[fd00::5]:8080"
    e.write_config()
    e.reload()
    u = url_of_new_run()
    assert (u.hostname, u.port) == ("fd00::5", 8080)
    assert u.netloc.endswith("@[fd00::5]:8080")


def test_explain_says_secret_unavailable_as_the_proxy_does(factory, world):
    """A pin whose secret is missing refuses its host with 403 secret_unavailable, and run
    explain now says the same (it said host_not_allowed), naming the pin and its secret: a
    static secret_file not there yet (the quickstart before var/github.token exists), a static
    `secret: NAME` pin after `egressctl secret rm`, a dynamic run's pin whose secret was
    deleted."""
    U = world.U
    missing = {}

    def mutate(cfg):
        missing["path"] = os.path.join(os.path.dirname(cfg["admin"]["token_file"]),
                                       "not-yet.token")
        r1 = cfg["runs"][0]
        r1["scope"] = {"org": "acme"}
        r1["pins"] += [
            {"host": f"nofile.test:{U}", "secret_file": missing["path"],
             "inject": {"type": "bearer"}},
            {"host": f"other.test:{U}", "secret": "st_tok", "inject": {"type": "bearer"}},
        ]
    e = factory.start(mutate=mutate)
    n = len(e.config["runs"][0]["pins"])

    def explain(run, url):
        return api_ok(e, "GET", f"/v1/runs/{run}/explain?url={urllib.parse.quote(url, safe='')}")

    def proxy_reason(auth, host):
        c, r = helpers.proxy_connect(e.proxy_port, f"{host}:{U}", auth)
        c.close()
        return r.status, r.egress_reason

    def settle(run, url, reason):
        """The explain answer once it says `reason` (a store change is applied by a rebuild;
        bounded)."""
        for _ in range(50):
            ex = explain(run, url)
            if ex["reason"] == reason:
                return ex
            time.sleep(0.1)
        raise AssertionError(f"explain {url}: {ex['decision']} ({ex['reason']}), want {reason}")

    # 1. A static secret_file that does not exist yet.
    ex = explain("r1", f"https://nofile.test:{U}/")
    assert (ex["decision"], ex["reason"]) == ("deny", "secret_unavailable"), ex
    assert ex["pin"] == {"id": f"r1-pin-{n - 2}", "host": f"nofile.test:{U}"}
    assert ex["secret"] == {"name": "not-yet.token", "source": "secret_file",
                            "file": missing["path"]}
    assert proxy_reason(world.auth("r1"), "nofile.test") == (403, "secret_unavailable")
    out = ctl_ok(e, "run", "explain", "r1", f"https://nofile.test:{U}/").out
    assert "decision: deny (secret_unavailable)" in out, out
    assert f"pin:      r1-pin-{n - 2}" in out and "not-yet.token" in out, out

    # 2. A static `secret: NAME` pin: live once put, unavailable again after `secret rm`.
    put_secret(e, "st_tok", sval("st"), org="acme")
    settle("r1", f"https://other.test:{U}/", "injected")
    ctl_ok(e, "secret", "rm", "st_tok", "--scope", "org=acme")
    ex = settle("r1", f"https://other.test:{U}/", "secret_unavailable")
    assert ex["decision"] == "deny", ex
    assert ex["pin"] == {"id": f"r1-pin-{n - 1}", "host": f"other.test:{U}"}
    assert ex["secret"]["name"] == "st_tok" and "scope" not in ex["secret"], ex
    assert isinstance(ex["chain"], list)
    assert proxy_reason(world.auth("r1"), "other.test") == (403, "secret_unavailable")

    # 3. A dynamic run whose pin's secret was deleted.
    put_secret(e, "dyn_tok", sval("dyn"), org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(api_host(world), "dyn_tok")])
    settle(run.id, f"https://{api_host(world)}/", "injected")
    ctl_ok(e, "secret", "rm", "dyn_tok", "--scope", "org=acme")
    ex = settle(run.id, f"https://{api_host(world)}/", "secret_unavailable")
    assert ex["decision"] == "deny", ex
    assert ex["pin"] == {"id": run.reply["pins"][0]["id"], "host": api_host(world)}
    assert ex["secret"]["name"] == "dyn_tok", ex
    assert proxy_reason(run.auth, "api.test") == (403, "secret_unavailable")
    # A host no pin names stays host_not_allowed, in both.
    ex = explain(run.id, f"https://unlisted.test:{U}/")
    assert (ex["reason"], ex["pin"], ex["secret"]) == ("host_not_allowed", None, None), ex
    assert proxy_reason(run.auth, "unlisted.test") == (403, "host_not_allowed")


def test_a_missing_secret_is_reported_only_for_the_ports_its_pin_covers(factory, world):
    """A pin without a port covers policy.allowed_ports only (decide_destination's port rule):
    with its secret missing, the proxy and run explain say secret_unavailable on those ports
    and port_not_allowed on another (as with the secret there: the present.test pin beside
    it), not secret_unavailable on every port."""
    U = world.U
    other = 22  # not in allowed_ports

    def mutate(cfg):
        r1 = cfg["runs"][0]
        assert other not in cfg["policy"]["allowed_ports"]
        r1["pins"] += [
            {"host": "missing.test", "inject": {"type": "bearer"},
             "secret_file": os.path.join(os.path.dirname(cfg["admin"]["token_file"]),
                                         "missing.token")},
            {"host": "present.test", "inject": {"type": "bearer"},
             "secret_file": r1["pins"][0]["secret_file"]},
        ]
    e = factory.start(mutate=mutate)

    def proxy_reason(host, port):
        c, r = helpers.proxy_connect(e.proxy_port, f"{host}:{port}", world.auth("r1"))
        c.close()
        return r.status, r.egress_reason

    def explain(host, port):
        url = urllib.parse.quote(f"https://{host}:{port}/", safe="")
        ex = api_ok(e, "GET", f"/v1/runs/r1/explain?url={url}")
        return ex["decision"], ex["reason"]
    assert proxy_reason("present.test", other) == (403, "port_not_allowed")
    assert proxy_reason("missing.test", other) == (403, "port_not_allowed")
    assert explain("missing.test", other) == ("deny", "port_not_allowed")
    assert proxy_reason("missing.test", U) == (403, "secret_unavailable")
    assert explain("missing.test", U) == ("deny", "secret_unavailable")


def test_egressctl_env_ca_bundle_reaches_intercepted_and_tunnelled_hosts(cp, world, api_secret,
                                                                         tmp_path):
    """The variables that replace a client's trust store (SSL_CERT_FILE, REQUESTS_CA_BUNDLE,
    CURL_CA_BUNDLE, GIT_SSL_CAINFO) name a bundle of the system roots plus the run CA, so a
    host egressd tunnels blind (tunnel.test, the upstream's own certificate) verifies as well
    as a pinned one; NODE_EXTRA_CA_CERTS (additive) keeps the run CA alone. They had all named
    the run CA alone. The test PKI's CA stands in for the system roots (--system-ca-file)."""
    roots = tmp_path / "system-roots.pem"
    with open(world.pki.ca) as f:
        roots_text = f.read()
    roots.write_text(roots_text)
    ca = tmp_path / "run-ca.pem"
    bundle = tmp_path / "run-ca-bundle.pem"
    r = ctl_ok(cp, "run", "create", "--scope", "org=acme",
               "--pin", f"{api_host(world)}=api_tok:bearer", "--env", "--ca-out", str(ca),
               "--system-ca-file", str(roots))
    exported = _parse_exports(r.out)
    for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO"):
        assert exported[k] == str(bundle), k
    assert exported["NODE_EXTRA_CA_CERTS"] == str(ca)
    ca_text = ca.read_text()
    assert ca_text.startswith("-----BEGIN CERTIFICATE-----") and ca_text.count("BEGIN") == 1
    assert bundle.read_text() == roots_text.rstrip("\n") + "\n" + ca_text
    assert oct(bundle.stat().st_mode & 0o777) == "0o644"

    env = helpers.clean_env(**exported)
    U = world.U
    for host, injected in ((api_host(world), True), (f"tunnel.test:{U}", False)):
        m_curl = "m-bundle-curl-" + pysecrets.token_hex(3)
        c = helpers.curl(["-o", "/dev/null", "-w", "%{http_code}",
                          f"https://{host}/echo/{m_curl}"], env=env, timeout=30)
        assert c.returncode == 0 and c.stdout == b"200", (host, c.returncode, c.stderr[-500:])
        m_py = "m-bundle-py-" + pysecrets.token_hex(3)
        p = subprocess.run([sys.executable, "-c",
                            "import requests, sys\n"
                            "r = requests.get(sys.argv[1], timeout=30)\n"
                            "print(r.status_code)\n",
                            f"https://{host}/echo/{m_py}"],
                           env=env, capture_output=True, timeout=60)
        assert p.returncode == 0 and p.stdout.strip() == b"200", (host, p.stderr[-800:])
        for m in (m_curl, m_py):
            got = seen_auth(world.upstream, m)
            expect(bool(got) == injected, f"{host}: Authorization {'not ' if injected else ''}"
                                          "seen upstream")

    # Without --env, --ca-bundle-out alone writes both files and names them in the JSON.
    b2 = tmp_path / "b2.pem"
    j = json.loads(ctl_ok(cp, "run", "create", "--scope", "org=acme", "--allow", "x.test",
                          "--ca-out", str(tmp_path / "c2.pem"), "--ca-bundle-out", str(b2),
                          "--system-ca-file", str(roots)).out)
    assert j["ca_bundle_file"] == str(b2) and b2.read_text().startswith(roots_text)
    # The bundle cannot be the CA file itself (NODE_EXTRA_CA_CERTS would name every root).
    same = ctl(cp, "run", "create", "--scope", "org=acme", "--allow", "x.test",
               "--ca-out", str(tmp_path / "s.pem"), "--ca-bundle-out",
               str(tmp_path / "." / "s.pem"), "--system-ca-file", str(roots))
    assert same.returncode != 0 and "same file" in same.err, same.err
    assert not (tmp_path / "s.pem").exists()
    # A trust store that cannot be read fails the command before a run is made.
    bad = ctl(cp, "run", "create", "--scope", "org=acme", "--allow", "x.test", "--env",
              "--ca-out", str(tmp_path / "c3.pem"), "--system-ca-file", str(tmp_path / "none"))
    assert bad.returncode == 1 and "--system-ca-file" in bad.err, bad.err
    assert not (tmp_path / "c3.pem").exists()
