"""Static runs whose pins name a store secret (`secret: NAME`, DESIGN's "or secret: NAME from the
store"): the sidecar's config says which secret, the store (file or etcd) holds its value, and
the run's `scope` picks the most specific one, as for a run made through the admin API. A pin
whose secret is not in the store is off (403 secret_unavailable) until it is put; a put,
rotation or delete reaches the next request without a reload.

Secret values never reach the test output (cp_helpers.expect), and the factory greps every
file egressd wrote for them when the module ends.
"""
from __future__ import annotations

import secrets as pysecrets
from urllib.parse import quote

import pytest
import yaml

import helpers
from cp_helpers import api, api_ok, expect, fp, put_secret, rotate_secret, seen_auth


def _store_pinned(world):
    U = world.U

    def mutate(cfg):
        r1 = cfg["runs"][0]
        r1["scope"] = {"org": "acme", "project": "web"}
        # among file pins (their order with store pins: runtime_ca_test's merge test)
        r1["pins"].insert(1, {"host": f"other.test:{U}", "secret": "gh",
                              "inject": {"type": "bearer"}})
    return mutate


@pytest.fixture(scope="module")
def e(factory, world):
    return factory.start(mutate=_store_pinned(world))


def _get(e, world, path: str, conn: helpers.Conn | None = None):
    c = conn or helpers.tunnel(e.proxy_port, "other.test", world.U, world.auth("r1"),
                               e.config["runs"][0]["ca_cert_out"])
    return c, helpers.request(c, "GET", path, f"other.test:{world.U}")


def _bearer_seen(world, marker: str) -> list[str]:
    return seen_auth(world.upstream, marker)


def _expect_injected(e, world, tag: str, value: str, what: str, conn=None):
    """GET /echo/store/<tag> (on `conn`, or a new tunnel): answered 200, and the upstream saw
    exactly `Bearer value`. Returns the connection; messages name secrets by fingerprint."""
    conn, resp = _get(e, world, f"/echo/store/{tag}", conn)
    got = _bearer_seen(world, tag)
    expect(resp.status == 200 and got == [f"Bearer {value}"],
           f"want the {what} {fp(value)}: {resp.status}, {[fp(g) for g in got]}")
    return conn


def _expect_refused_unavailable(e, world):
    c, r = helpers.proxy_connect(e.proxy_port, f"other.test:{world.U}", world.auth("r1"))
    c.close()
    assert r.status == 403 and r.egress_reason == "secret_unavailable", (r.status, r.egress_reason)


def test_store_pin_follows_the_store_without_a_reload(e, world, marker):
    # 1. Not in the store yet: the pinned host is refused, and the log says which key and why.
    _expect_refused_unavailable(e, world)
    log = e.stderr_text()
    assert (f"runs[0].pins[1].secret: no secret 'gh' for scope org=acme,project=web in the "
            f"store; pin for other.test:{world.U} disabled until the secret is put") in log, log[-3000:]

    # 2. A secret of another org is never used; the org's one is, without a reload.
    evil = "sk-evil-" + pysecrets.token_hex(16)
    put_secret(e, "gh", evil, org="globex")
    org_v = "sk-org-" + pysecrets.token_hex(16)
    put_secret(e, "gh", org_v, org="acme")
    conn = _expect_injected(e, world, f"{marker}-1", org_v, "org secret")

    # 3. A more specific secret (the run's project) wins, on the same connection.
    proj_v = "sk-proj-" + pysecrets.token_hex(16)
    put_secret(e, "gh", proj_v, org="acme", project="web")
    _expect_injected(e, world, f"{marker}-2", proj_v, "project secret", conn)

    # 4. Rotated: the next request on the same connection carries the new value.
    rot_v = "sk-rot-" + pysecrets.token_hex(16)
    rotate_secret(e, "gh", rot_v, org="acme", project="web")
    _expect_injected(e, world, f"{marker}-3", rot_v, "rotated secret", conn)

    # 5. Explain names the store secret, its scope and version, and the scope chain.
    ex = api_ok(e, "GET", "/v1/runs/r1/explain?url=" +
                quote(f"https://other.test:{world.U}/echo/store/x", safe=""))
    assert ex["decision"] == "inject" and ex["pin"]["id"] == "r1-pin-1", ex
    assert ex["secret"] == {"name": "gh", "scope": {"org": "acme", "project": "web"},
                            "version": 2}, ex
    assert sum(c["chosen"] for c in ex["chain"]) == 1
    assert [c["matches"] for c in ex["chain"] if c["scope"] == {"org": "globex"}] == [False]
    conn.close()

    # 6. Deleted: back to the org's secret; that deleted too, the host is refused again.
    assert api(e, "DELETE", "/v1/secrets/gh?scope=" + quote("org=acme,project=web")).status == 204
    _expect_injected(e, world, f"{marker}-5", org_v, "org secret after the delete").close()
    assert api(e, "DELETE", "/v1/secrets/gh?scope=org%3Dacme").status == 204
    _expect_refused_unavailable(e, world)
    # api.test's file pin on the same run was never disturbed
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth("r1"),
                       e.config["runs"][0]["ca_cert_out"])
    resp = helpers.request(c, "GET", f"/echo/{marker}-6", f"api.test:{world.U}")
    c.close()
    got = _bearer_seen(world, f"{marker}-6")
    expect(resp.status == 200 and got == [f"Bearer {world.secrets['api_token']}"], "api.test pin")


def test_reload_keeps_the_ca_and_the_resolved_pin(e, world, marker):
    v = "sk-reload-" + pysecrets.token_hex(16)
    put_secret(e, "gh", v, org="acme", project="web")
    ca_file = e.config["runs"][0]["ca_cert_out"]
    with open(ca_file) as f:
        ca_before = f.read()
    e.rewrite_config(lambda c: c["runs"][0]["allow_hosts"].append("tunnel.test"))
    e.reload()
    with open(ca_file) as f:
        assert f.read() == ca_before, "a reload that keeps the run must keep its CA"
    _expect_injected(e, world, marker, v, "secret after the reload").close()

    # A reload that changes the run's scope resolves the pin again, by the new scope.
    gv = "sk-globex-" + pysecrets.token_hex(16)
    put_secret(e, "gh", gv, org="globex", project="web")
    e.rewrite_config(lambda c: c["runs"][0].__setitem__("scope", {"org": "globex", "project": "web"}))
    e.reload()
    _expect_injected(e, world, f"{marker}-g", gv, "new scope's secret after the reload").close()


def test_the_admin_api_shows_a_static_run_and_refuses_to_change_it(e, world):
    """GET /v1/runs/{id} of a static run shows what the config made of it ("static": true,
    its file and store pins with their secrets' names, no expiry for a run as long as the
    process, its CA), never its token; a revoke or a pin added through the API is a 409 saying
    to change the config and reload, not a 404; an unknown id is still 404."""
    j = api_ok(e, "GET", "/v1/runs/r1")
    assert j["static"] is True and j["id"] == "r1", j
    with open(e.config_path) as f:  # as the last reload left it
        cfg = yaml.safe_load(f)["runs"][0]
    assert j["scope"] == cfg["scope"], (j["scope"], cfg["scope"])
    assert j["expires_at"] is None and j["expired"] is False and j["revoked"] is False, j
    hosts = [p["host"] for p in j["pins"]]
    cfg_pins = cfg["pins"]
    assert sorted(hosts) == sorted(p["host"] for p in cfg_pins), (hosts, cfg_pins)
    store = [p for p in j["pins"] if p["host"] == f"other.test:{world.U}"]
    assert len(store) == 1 and store[0]["secret"] == "gh", store
    assert store[0]["inject"]["type"] == "bearer" and store[0]["expires_at"] is None, store
    hdr = [p for p in j["pins"] if p["host"].startswith("hdr.test")]
    assert hdr[0]["inject"] == {"type": "header", "name": "x-api-key",
                                "template": "Key {secret}"}, hdr
    with open(e.config["runs"][0]["ca_cert_out"]) as f:
        assert j["ca_pem"] == f.read()
    assert world.tokens["r1"] not in api(e, "GET", "/v1/runs/r1").body.decode()
    for method, path, body in (("DELETE", "/v1/runs/r1", None),
                               ("POST", "/v1/runs/r1/pins",
                                {"host": f"api.test:{world.U}", "secret": "gh",
                                 "inject": {"type": "bearer"}})):
        r = api(e, method, path, body)
        assert r.status == 409 and "static run" in r.json["detail"], (method, r.status, r.body)
    assert api(e, "GET", "/v1/runs/r9").status == 404
    # still serving (the refused revoke did nothing)
    c, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", world.auth("r1"))
    c.close()
    assert r.status == 200, r.status


def test_a_store_secret_that_is_no_aws_credentials_document(factory, world, marker):
    """A static aws-sigv4 pin without access_key_id takes a credentials document from the
    store: a value that is none is named in the log (the pin, the problem, no value) and its
    requests are refused 503 aws_credentials_invalid, never sent unsigned."""
    U = world.U

    def mutate(cfg):
        r1 = cfg["runs"][0]
        r1["scope"] = {"org": "acme"}
        r1["pins"].append({"host": f"enc.test:{U}", "secret": "aws_role",
                           "inject": {"type": "aws-sigv4", "region": "us-east-1",
                                      "service": "s3"}})
        cfg["resolver"]["overrides"]["enc.test"] = ["127.0.0.1"]
    e = factory.start(mutate=mutate)
    key = "wJalrXUtnFEMI/K7MDENG+" + pysecrets.token_hex(9)
    put_secret(e, "aws_role", key, org="acme")  # the bare key, not a document
    where = f"runs[0].pins[{len(e.config['runs'][0]['pins']) - 1}].secret"
    helpers.poll(lambda: f"{where}: credentials document: not JSON" in e.stderr_text(), 5,
                 "the warning naming the pin")
    line = [ln for ln in e.stderr_text().splitlines() if where in ln][-1]
    assert f"requests for enc.test:{U} are refused (503 aws_credentials_invalid)" in line, line
    n0 = len(world.upstream.requests)
    c = helpers.tunnel(e.proxy_port, "enc.test", U, world.auth("r1"),
                       e.config["runs"][0]["ca_cert_out"])
    resp = helpers.request(c, "GET", f"/echo/{marker}", f"enc.test:{U}")
    c.close()
    assert (resp.status, resp.egress_reason) == (503, "aws_credentials_invalid")
    assert world.upstream.find(marker) == [] and len(world.upstream.requests) == n0
