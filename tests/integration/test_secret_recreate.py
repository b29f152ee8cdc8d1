"""A secret deleted and created again under the same name and scope is a new secret: every
replica injects the new value, including one that never saw the state in between.

POST /v1/secrets stores version 1, so a secret deleted and put again has the name, scope and
version it had before. A replica whose watch is cut while that happens resynchronizes from
etcd's whole state once it is back: it sees the secret replaced in one step, never the
"missing" state between. Before the fix its runs were rebuilt only when name@scope + version
changed, so the replica kept the Run objects of the old value and went on injecting it (and
holding it in memory). Here replica A reaches etcd through a TCP relay the test cuts: B
deletes and re-creates the secret while A is cut off, the relay comes back, A resynchronizes,
and both a dynamic run (through A and through B) and a static run of A's config with a store
pin (`secret: NAME`) must inject the new value, and A must hold no copy of the old one.

Secret values never reach the test output (cp_helpers.expect, fingerprints only).
"""
from __future__ import annotations

import os
import re
import secrets as pysecrets
import time

import pytest

import helpers
from cp_helpers import api, api_ok, bearer_pin, create_run, expect, fp, put_secret, seen_auth
from etcd_helpers import CuttableRelay, Etcd, require_etcd_bin
from test_fleet import (PROPAGATE_S, api_host, make_replica, on, start_replica, state_revision,
                        sval, wait_run_known)


@pytest.fixture(scope="module")
def etcd(world):
    e = Etcd(require_etcd_bin(), world.new_dir("etcd-recreate-")).start()
    yield e
    e.stop()


def _static_store_run(world):
    """A's config: one static run, scope org=acme, whose only pin takes secret `tok` from the
    store (other.test); its proxy token is world's r1 token (base_config wrote the file)."""
    def then(cfg: dict):
        wd = os.path.dirname(cfg["audit"]["path"])
        cfg["runs"] = [{
            "id": "sc", "token_file": os.path.join(wd, "r1.token"),
            "scope": {"org": "acme"}, "ca_cert_out": os.path.join(wd, "sc-ca.pem"),
            "allow_hosts": [],
            "pins": [{"host": f"other.test:{world.U}", "secret": "tok",
                      "inject": {"type": "bearer"}}],
        }]
    return then


def _seen(world, conn_factory, host: str, tag: str) -> list[str]:
    """One GET /bytes through a new tunnel (the response does not echo the credential, so
    egressd keeps no unwiped copy of it): the Authorization values the upstream saw."""
    marker = f"m-rc-{tag}-" + pysecrets.token_hex(4)
    c = conn_factory()
    try:
        resp = helpers.request(c, "GET", f"/bytes/64?{marker}", f"{host}:{world.U}")
    finally:
        c.close()
    expect(resp.status == 200, f"{tag}: GET -> {resp.status} {resp.egress_reason}")
    return seen_auth(world.upstream, marker)


def _which(got: list[str], values: dict[str, str]) -> str:
    """Names the value a request carried ("old", "new"), never the value itself."""
    for name, v in values.items():
        if got == [f"Bearer {v}"]:
            return name
    return f"something else ({[fp(g) for g in got]})"


def test_a_secret_deleted_and_created_again_while_a_replica_is_cut_off(factory, world, etcd,
                                                                         request):
    relay = CuttableRelay(etcd.client_port)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40]
    prefix = f"/egressd-test-{slug}-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)
    a = b = None
    try:
        a = start_replica(factory, make_replica(factory, world, prefix, [relay.url], key,
                                                then=_static_store_run(world)))
        b = start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key))
        v1, v2 = sval("old"), sval("new")
        put_secret(b, "tok", v1, org="acme")
        for v in (v1, v2):
            a.secrets[f"cp:tok:{fp(v)}"] = v  # A must never write either value either
            b.secrets[f"cp:tok:{fp(v)}"] = v
        run = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "tok")])
        wait_run_known(a, run, world)
        ra = on(run, a)
        dyn_a = lambda: ra.tunnel("api.test", world.U)  # noqa: E731
        dyn_b = lambda: run.tunnel("api.test", world.U)  # noqa: E731
        static_a = lambda: helpers.tunnel(  # noqa: E731
            a.proxy_port, "other.test", world.U, helpers.basic_auth("sc", world.tokens["r1"]),
            a.config["runs"][0]["ca_cert_out"])
        values = {"old": v1, "new": v2}
        helpers.poll(lambda: _which(_seen(world, static_a, "other.test", "sa0"), values) == "old",
                     PROPAGATE_S, "A's static run to inject the secret put on B", interval=0.05)
        for name, conn, tag in (("A", dyn_a, "da0"), ("B", dyn_b, "db0")):
            got = _which(_seen(world, conn, "api.test", tag), values)
            expect(got == "old", f"{name}: the first value not injected: {got}")

        # A is cut off from etcd; B deletes the secret and creates it again (version 1 both
        # times), then A's watch comes back and resynchronizes in one step.
        cut_at = state_revision(a)
        relay.cut()
        assert api(b, "DELETE", "/v1/secrets/tok?scope=org%3Dacme").status == 204
        created = put_secret(b, "tok", v2, org="acme")
        assert created["version"] == 1, created
        want_rev = state_revision(b)
        time.sleep(0.3)  # A notices the cut: its watch ends, its resyncs fail
        # A saw neither change (else it would have rebuilt with the secret missing between)
        assert state_revision(a) == cut_at, (state_revision(a), cut_at)
        relay.restore()
        helpers.poll(lambda: state_revision(a) >= want_rev, 15.0,
                     f"A to resynchronize to revision {want_rev} after the cut")
        listed = {s["name"]: (s["version"], s["created_at"])
                  for s in api_ok(a, "GET", "/v1/secrets")["secrets"]}
        assert listed.get("tok") == (1, created["created_at"]), listed

        got = {what: _which(_seen(world, conn, host, tag), values)
               for what, conn, host, tag in (("B, dynamic run", dyn_b, "api.test", "db1"),
                                             ("A, dynamic run", dyn_a, "api.test", "da1"),
                                             ("A, static run", static_a, "other.test", "sa1"))}
        wrong = {what: g for what, g in got.items() if g != "new"}
        expect(not wrong, f"not the re-created secret's value (want new): {wrong}")
        n = helpers.copies_in_memory(a.proc.pid, v1, lambda n: n == 0)
        expect(n == 0, f"A still holds {n} copies of the deleted secret's value")
    finally:
        relay.close()
        for e in (a, b):
            if e is not None and e.alive():
                e.stop()
