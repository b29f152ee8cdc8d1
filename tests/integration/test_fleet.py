"""A fleet: replicas sharing secrets, runs and run CAs through etcd (`state.backend: etcd`).

DESIGN: "many replicas behind a Service share secrets and runs through etcd; a run is an etcd
lease, so expiry and revocation reach every replica through a watch, within a second".

One etcd (etcd_helpers.Etcd, loopback only, temp data) serves the module; each test starts
two replicas, A and B, on a key prefix of its own (no test sees another's state). The replicas
share one master key (each has its own copy of the file, as each pod mounts the same Secret),
so each unseals the other's secrets and run CA keys; each keeps its own ports, audit file and
admin token. A run's proxy URL names the replica that created it: `on(run, replica)` is the
same run (token, CA file) through another replica.

Secret values never reach the test output (cp_helpers.expect, fingerprints only); the factory
greps every file each replica wrote for them when the module ends, and
test_no_secret_value_reaches_etcd_or_any_output greps etcd's keys, values and files too.
"""
from __future__ import annotations

import copy
import dataclasses
import contextlib
import os
import re
import secrets as pysecrets
import signal
import socket
import threading
import time
import urllib.request
from dataclasses import dataclass

import pytest
import yaml

import helpers
import upstream
from cp_helpers import (SEEN, DynRun, api, api_ok, bearer_pin, contains_any, cp_mutate,
                        create_run, expect, fp, get_via, kms_stub, put_secret,
                        refused_or_closed, rotate_secret, seen_auth)
from dns_server import DnsServer, fixed
from etcd_helpers import Etcd, EtcdTls, GatewayRelay, b64, prefix_end, require_etcd_bin

# DESIGN's bound for a change made on one replica to reach every other (the watch). A
# sanitizer build rebuilds its runtime several times slower: the bound is doubled there.
PROPAGATE_S = 1.0 * (2 if helpers.SANITIZER else 1)


def sval(tag: str) -> str:
    return helpers.secret(f"flv-{tag}-" + pysecrets.token_hex(16))


def api_host(w) -> str:
    return f"api.test:{w.U}"


# ---------------------------------------------------------------------------------------------
# etcd and the fleet


@pytest.fixture(scope="module")
def etcd(world):
    """One etcd for the module (skipped without the binary, a failure when CI=true)."""
    e = Etcd(require_etcd_bin(), world.new_dir("etcd-")).start()
    yield e
    e.stop()


@dataclass
class Fleet:
    a: helpers.Egressd
    b: helpers.Egressd
    prefix: str
    etcd: Etcd


def etcd_state(prefix: str, endpoints: list[str], **etcd_keys):
    def extra(cfg: dict):
        cfg["state"]["backend"] = "etcd"
        cfg["state"]["etcd"] = {"endpoints": list(endpoints), "prefix": prefix, **etcd_keys}
    return extra


def make_replica(factory, world, prefix: str, endpoints: list[str],
                 master_key: bytes, *, then=None, **etcd_keys) -> helpers.Egressd:
    """A replica of the fleet, not started: the control-plane config on the etcd backend
    (etcd_keys: more state.etcd keys; then: a last change to the config), the fleet's master
    key written to its own keys.master_key_file (32 bytes, 0600)."""
    def extra(cfg: dict):
        etcd_state(prefix, endpoints, **etcd_keys)(cfg)
        if then:
            then(cfg)
    e = factory.make(mutate=cp_mutate(world, extra=extra))
    mk = e.config["keys"]["master_key_file"]
    os.makedirs(os.path.dirname(mk), mode=0o700, exist_ok=True)
    fd = os.open(mk, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(master_key)
    os.chmod(mk, 0o600)
    return e


def start_replica(factory, e: helpers.Egressd) -> helpers.Egressd:
    e.start()
    factory.started.append(e)  # the factory checks its exit status and leaks at module end
    return e


@pytest.fixture
def fleet(factory, world, etcd, request):
    """Replicas A and B on a fresh key prefix; stopped when the test ends."""
    if not etcd.running():  # a test that stopped it failed before starting it again
        etcd.start()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:40]
    prefix = f"/egressd-test-{slug}-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)
    a = start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key))
    b = start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key))
    yield Fleet(a, b, prefix, etcd)
    for e in (a, b):
        if e.alive():
            e.stop()


def on(run: DynRun, e: helpers.Egressd) -> DynRun:
    """The same run (id, token, CA file) used through replica e."""
    return dataclasses.replace(run, proxy_port=e.proxy_port)


def wait_run_known(e: helpers.Egressd, run: DynRun, world,
                   timeout: float = PROPAGATE_S) -> float:
    """Polls e until it knows the run both in its admin API (GET /v1/runs/ID 200) and on its
    data path (a CONNECT with the run's token is admitted: the runtime is rebuilt after the
    state arrives); returns how long it took."""
    t0 = time.monotonic()
    helpers.poll(lambda: api(e, "GET", f"/v1/runs/{run.id}").status == 200
                 and connect_status(on(run, e), api_host(world))[0] == 200, timeout,
                 f"run {run.id} on replica :{e.admin_port}", interval=0.02)
    return time.monotonic() - t0


def state_revision(e: helpers.Egressd) -> int:
    """egressd_state_revision from e's /metrics."""
    got = e.admin_get("/metrics")
    assert got and got[0] == 200, got
    m = re.search(rb"^egressd_state_revision (\d+)$", got[1], re.M)
    assert m, "no egressd_state_revision in /metrics"
    return int(m.group(1))


def secret_names(e: helpers.Egressd) -> list[str]:
    return [s["name"] for s in api_ok(e, "GET", "/v1/secrets")["secrets"]]


def injected(world, run: DynRun, value: str, tag: str) -> bool:
    """One GET /echo through the run (a new tunnel): 200 and exactly `Bearer value` upstream."""
    marker = f"m-{tag}-" + pysecrets.token_hex(4)
    c, resp = get_via(run, "api.test", world.U, f"/echo/{marker}")
    c.close()
    expect(resp.status == 200, f"GET through :{run.proxy_port} -> {resp.status} "
                               f"{resp.egress_reason}")
    return seen_auth(world.upstream, marker) == [f"Bearer {value}"]


def connect_status(run: DynRun, target: str) -> tuple[int, str | None]:
    c, resp = helpers.proxy_connect(run.proxy_port, target, run.auth)
    c.close()
    return resp.status, resp.egress_reason


# ---------------------------------------------------------------------------------------------
# sharing


def test_a_run_created_on_one_replica_serves_on_another(fleet, world, marker):
    """A secret and a pinned run created on A are on B within a second (same pins, same CA),
    and a real client through B, with the run's token and trusting the CA A handed out, gets
    the credential injected."""
    a, b = fleet.a, fleet.b
    v = sval("share")
    put_secret(a, "fleet_tok", v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "fleet_tok")])
    took = wait_run_known(b, run, world)
    shown_a = api_ok(a, "GET", f"/v1/runs/{run.id}")
    shown_b = api_ok(b, "GET", f"/v1/runs/{run.id}")
    for k in ("id", "scope", "pins", "allow_hosts", "expires_at", "revoked", "ca_pem"):
        assert shown_b.get(k) == shown_a.get(k), f"B shows another {k} than A"
    assert shown_b["ca_pem"] == run.reply["ca_pem"], "B does not use the run CA A handed out"
    assert "fleet_tok" in secret_names(b), "B does not list the secret put on A"

    url = f"https://api.test:{world.U}/echo/{marker}"
    r = helpers.curl(["-x", b.proxy_url(run.id, run.token), "--cacert", run.ca_file,
                      "-o", "/dev/null", "-w", "%{http_code}", url], timeout=20)
    assert r.returncode == 0, f"curl through B: rc {r.returncode}: {r.stderr.decode()[-500:]}"
    assert r.stdout == b"200", f"curl through B: HTTP {r.stdout!r}"
    expect(seen_auth(world.upstream, marker) == [f"Bearer {v}"],
           f"B did not inject the secret put on A ({fp(v)}); the run reached B in {took:.2f}s")
    # the helpers' own client too, and A serves it as well
    expect(injected(world, on(run, b), v, "share-b"), "B: not injected (raw tunnel)")
    expect(injected(world, run, v, "share-a"), "A: not injected")


def test_revocation_on_one_replica_reaches_the_other_within_a_second(fleet, world):
    """A run created on A and revoked on B: within a second A refuses the run's token with
    403 run_revoked, cuts the blind tunnel that was open on it, and sends nothing more on the
    intercepted connection that was open."""
    a, b = fleet.a, fleet.b
    v = sval("rev")
    put_secret(a, "rev_tok", v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "rev_tok")],
                     allow=["tunnel.test"])
    wait_run_known(b, run, world)
    marker = "m-fleet-rev-" + pysecrets.token_hex(3)
    intercepted = run.tunnel("api.test", world.U)
    assert helpers.request(intercepted, "GET", f"/echo/{marker}", api_host(world)).status == 200
    c, resp = helpers.proxy_connect(a.proxy_port, f"tunnel.test:{world.U}", run.auth)
    assert resp.status == 200, (resp.status, resp.egress_reason)
    blind = helpers.tls_wrap(c, "tunnel.test", world.pki.ca)
    assert helpers.request(blind, "GET", f"/echo/{marker}-b", f"tunnel.test:{world.U}") \
        .status == 200
    assert not helpers.closed_by_peer(blind) and not helpers.closed_by_peer(intercepted)

    api_ok(b, "DELETE", f"/v1/runs/{run.id}")
    t0 = time.monotonic()

    def refused_on_a():
        st = connect_status(run, api_host(world))
        return st if st[0] != 200 else None
    st = helpers.poll(refused_on_a, PROPAGATE_S, "A to refuse the run revoked on B")
    assert st == (403, "run_revoked"), \
        f"A refused the revoked run with {st} after {time.monotonic() - t0:.2f}s"
    helpers.poll(lambda: helpers.closed_by_peer(blind), PROPAGATE_S,
                 "A to close the blind tunnel of the run revoked on B", interval=0.02)
    st = refused_or_closed(intercepted, api_host(world), f"/echo/{marker}-after")
    assert st in ((None, "closed"), (403, "run_revoked")), st
    assert not world.upstream.find(f"{marker}-after"), "a request went out on A after the revoke"
    intercepted.close()
    blind.close()
    # B refuses it too, both show it revoked, and a new tunnel on A is refused as well.
    assert connect_status(on(run, b), api_host(world)) == (403, "run_revoked")
    assert connect_status(run, f"tunnel.test:{world.U}") == (403, "run_revoked")
    for e in (a, b):
        assert api_ok(e, "GET", f"/v1/runs/{run.id}")["revoked"] is True


def test_a_rotated_secret_applies_on_every_replica(fleet, world):
    """A secret rotated on A: B's next requests inject the new value within a bound, on a
    keep-alive connection opened before the rotation and on a new one."""
    a, b = fleet.a, fleet.b
    v1, v2 = sval("rot1"), sval("rot2")
    put_secret(a, "rot_tok", v1, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "rot_tok")])
    wait_run_known(b, run, world)
    rb = on(run, b)
    conn = rb.tunnel("api.test", world.U)
    marker = "m-fleet-rot-" + pysecrets.token_hex(3)
    assert helpers.request(conn, "GET", f"/echo/{marker}-0", api_host(world)).status == 200
    expect(seen_auth(world.upstream, f"{marker}-0") == [f"Bearer {v1}"], "B: v1 not injected")

    rotate_secret(a, "rot_tok", v2, org="acme")
    n = [0]

    def b_sends_v2():
        n[0] += 1
        m = f"{marker}-{n[0]}"
        r = helpers.request(conn, "GET", f"/echo/{m}", api_host(world))
        assert r.status == 200, (r.status, r.egress_reason)
        got = seen_auth(world.upstream, m)
        expect(got in ([f"Bearer {v1}"], [f"Bearer {v2}"]),
               "B injected neither the old nor the new value")
        return got == [f"Bearer {v2}"]
    helpers.poll(b_sends_v2, 2.0 * PROPAGATE_S, "B to inject the value rotated on A",
                 interval=0.05)
    conn.close()
    expect(injected(world, rb, v2, "rot-b-new"), "B: a new connection did not get v2")
    expect(injected(world, run, v2, "rot-a-new"), "A: not v2 after its own rotation")
    versions = {s["name"]: s["version"] for s in api_ok(b, "GET", "/v1/secrets")["secrets"]}
    assert versions.get("rot_tok") == 2, versions


def test_a_restarted_replica_loads_the_fleet_state(fleet, world):
    """A is stopped; meanwhile B creates a run and rotates the secret. A, started again, serves
    the run created before (same CA) and the one created while it was down, with the value
    rotated while it was down, as soon as it is ready."""
    a, b = fleet.a, fleet.b
    v1, v2 = sval("rs1"), sval("rs2")
    put_secret(a, "rs_tok", v1, org="acme")
    before = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "rs_tok")])
    wait_run_known(b, before, world)
    assert a.stop() == 0, a.stderr_text()[-2000:]

    during = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "rs_tok")])
    rotate_secret(b, "rs_tok", v2, org="acme")
    expect(injected(world, during, v2, "rs-b"), "B: run created while A was down: not v2")

    a.start()
    for run in (before, during):
        r = api(a, "GET", f"/v1/runs/{run.id}")
        assert r.status == 200, f"restarted A does not know run {run.id}: {r.status}"
        assert r.json["ca_pem"] == run.reply["ca_pem"], f"run {run.id}: another CA on A"
        expect(injected(world, on(run, a), v2, "rs-a"),
               f"restarted A: run {run.id} does not inject the value rotated while it was down")
    expect(injected(world, on(before, b), v2, "rs-b2"), "B: run from before: not v2")


# ---------------------------------------------------------------------------------------------
# failures


def test_an_etcd_outage_keeps_the_data_path_serving(fleet, world):
    """etcd stops: both replicas keep injecting for the runs they hold; an admin write answers
    a 5xx JSON error naming etcd, and nothing dies. etcd back: within a bound a write on A
    succeeds and reaches B (B's watch resumed); the write refused during the outage is
    nowhere."""
    a, b = fleet.a, fleet.b
    v = sval("out")
    put_secret(a, "out_tok", v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "out_tok")])
    wait_run_known(b, run, world)

    fleet.etcd.stop()
    try:
        expect(injected(world, run, v, "out-a0"), "A: not injected just after etcd stopped")
        time.sleep(1.5)  # long enough for both replicas to have seen their watch break
        expect(injected(world, run, v, "out-a1"), "A: not injected during the etcd outage")
        expect(injected(world, on(run, b), v, "out-b1"), "B: not injected during the outage")

        t0 = time.monotonic()
        r = api(a, "POST", "/v1/secrets", {"name": "during_outage", "scope": {"org": "acme"},
                                           "value": sval("lost")}, timeout=30)
        took = time.monotonic() - t0
        assert 500 <= r.status < 600, f"admin write with etcd down -> {r.status}: {r.body[:300]!r}"
        assert r.headers.get("content-type", "").startswith("application/json"), r.headers
        j = r.json
        assert set(j) == {"error", "detail"} and j["error"], j
        assert "etcd" in j["detail"].lower(), f"the error does not name etcd: {j}"
        assert took < 15, f"the write with etcd down took {took:.1f}s to fail"
        assert a.alive() and b.alive(), "a replica died with etcd down"
        assert api(a, "GET", "/healthz", token=None).status == 200
        expect(injected(world, run, v, "out-a2"), "A: not injected after the failed write")
    finally:
        fleet.etcd.start()

    n = [0]

    def write_succeeds():
        n[0] += 1
        name = f"after_outage_{n[0]}"
        r = api(a, "POST", "/v1/secrets", {"name": name, "scope": {"org": "acme"},
                                           "value": sval("back")}, timeout=30)
        return name if r.status == 201 else None
    name = helpers.poll(write_succeeds, 15.0, "an admin write on A after etcd came back",
                        interval=0.25)
    helpers.poll(lambda: name in secret_names(b), 5.0,
                 f"B to see {name} written on A after the outage (its watch resumed)")
    for e in (a, b):
        assert "during_outage" not in secret_names(e), "the refused write was applied"
    expect(injected(world, on(run, b), v, "out-b2"), "B: not injected after the outage")
    # and a change made on B after the outage reaches A (A's watch resumed too)
    put_secret(b, "after_outage_b", sval("back-b"), org="acme")
    helpers.poll(lambda: "after_outage_b" in secret_names(a), 5.0,
                 "A to see a secret written on B after the outage")


def test_concurrent_writes_from_two_replicas_all_land(fleet, world):
    """Two writers, one per replica, each put 10 secrets at once: every write lands, and both
    replicas list all 20 (each once, version 1); one put on A is injected by a run on B."""
    a, b = fleet.a, fleet.b
    names = {a: [f"conc_a_{i:02d}" for i in range(10)], b: [f"conc_b_{i:02d}" for i in range(10)]}
    values = {n: sval(n) for ns in names.values() for n in ns}
    errors: list[str] = []
    start = threading.Barrier(2)

    def writer(e):
        try:
            start.wait(timeout=10)
            for n in names[e]:
                put_secret(e, n, values[n], org="acme")
        except Exception as ex:  # noqa: BLE001 - reported below (no value in the message)
            errors.append(f"{type(ex).__name__}: {ex}")
    threads = [threading.Thread(target=writer, args=(e,)) for e in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a writer is stuck"
    assert not errors, errors
    want = set(values)
    for e in (a, b):
        helpers.poll(lambda: want <= set(secret_names(e)), 2.0 * PROPAGATE_S,
                     f"all 20 secrets listed on :{e.admin_port}")
        listed = [s for s in api_ok(e, "GET", "/v1/secrets")["secrets"] if s["name"] in want]
        assert len(listed) == 20, sorted(s["name"] for s in listed)
        assert all(s["version"] == 1 for s in listed), listed
    run = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "conc_a_09")])
    expect(injected(world, run, values["conc_a_09"], "conc"),
           "B did not inject a secret written on A")
    # egressd_state_revision: each replica serves a state at least as new as the last write
    newest = fleet.etcd.max_mod_revision(fleet.prefix)
    assert newest > 0
    for e in (a, b):
        helpers.poll(lambda: state_revision(e) >= newest, 2.0 * PROPAGATE_S,
                     f":{e.admin_port} egressd_state_revision to reach {newest}")


def test_concurrent_rotations_of_one_secret_never_share_a_version(fleet, world):
    """Two writers rotate the SAME secret at once, one per replica: each answer is 200 with a
    version no other 200 has, or 409 conflict (the other replica's rotation won the race; no
    value is silently overwritten under one version), and both replicas end on version
    1 + the number of 200s, injecting the value that version was answered for."""
    a, b = fleet.a, fleet.b
    put_secret(a, "race_tok", sval("race-0"), org="acme")
    helpers.poll(lambda: "race_tok" in secret_names(b), PROPAGATE_S, "B to list race_tok")
    answers: list[tuple[int, int | None, str]] = []  # (status, version, value)
    lock = threading.Lock()
    start = threading.Barrier(2)

    def writer(e, tag):
        start.wait(timeout=10)
        for i in range(8):
            v = sval(f"race-{tag}{i}")
            e.secrets[f"cp:race_tok:{fp(v)}"] = v  # never in egressd's output
            r = api(e, "PUT", "/v1/secrets/race_tok", {"scope": {"org": "acme"}, "value": v})
            with lock:
                answers.append((r.status, r.json.get("version") if r.status == 200 else None,
                                v if r.status == 200 else r.body.decode(errors="replace")))
    threads = [threading.Thread(target=writer, args=(e, t)) for e, t in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a writer is stuck"
    bad = [(s, body[:200]) for s, _, body in answers if s not in (200, 409)]
    assert not bad, bad
    conflicts = [body for s, _, body in answers if s == 409]
    assert all('"conflict"' in body for body in conflicts), conflicts[:2]
    versions = [ver for s, ver, _ in answers if s == 200]
    assert len(versions) == len(set(versions)), f"two 200s share a version: {sorted(versions)}"
    final = 1 + len(versions)
    assert max(versions) == final, (sorted(versions), final)
    last_value = next(v for s, ver, v in answers if s == 200 and ver == final)
    for e in (a, b):
        helpers.poll(lambda: [s["version"] for s in api_ok(e, "GET", "/v1/secrets")["secrets"]
                              if s["name"] == "race_tok"] == [final],
                     2.0 * PROPAGATE_S, f":{e.admin_port} to show version {final}")
    run = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "race_tok")])
    expect(injected(world, run, last_value, "race"),
           "B does not inject the value of the last version answered")
    expect(injected(world, on(run, a), last_value, "race-a"),
           "A does not inject the value of the last version answered")


def test_a_revoke_racing_a_pin_on_another_replica_is_never_undone(fleet, world):
    """A revoke on one replica and a pin added on the other at the same moment, five times:
    whichever lands first, the run ends revoked on both replicas (a pin made from the record
    before the revoke is refused with 409 or applied before it, never written over it)."""
    a, b = fleet.a, fleet.b
    put_secret(a, "rv_tok", sval("rv"), org="acme")
    for i in range(5):
        run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "rv_tok")])
        wait_run_known(b, run, world)
        start = threading.Barrier(2)
        status: dict[str, int] = {}

        def revoke():
            start.wait(timeout=10)
            status["revoke"] = api(b, "DELETE", f"/v1/runs/{run.id}").status

        def pin():
            start.wait(timeout=10)
            status["pin"] = api(a, "POST", f"/v1/runs/{run.id}/pins",
                                bearer_pin(api_host(world), "rv_tok", path_prefixes=[f"/p{i}/"])
                                ).status
        threads = [threading.Thread(target=f) for f in (revoke, pin)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert status.get("revoke") == 200, status
        assert status.get("pin") in (201, 409), status
        for e in (a, b):
            helpers.poll(lambda: api_ok(e, "GET", f"/v1/runs/{run.id}")["revoked"] is True,
                         2.0 * PROPAGATE_S, f"run {run.id} revoked on :{e.admin_port}")
        # and it stays so: nothing in flight can write the unrevoked record back
        time.sleep(0.2)
        for e in (a, b):
            assert api_ok(e, "GET", f"/v1/runs/{run.id}")["revoked"] is True, (i, e.admin_port)


def test_an_expired_run_is_refused_everywhere_and_leaves_etcd(fleet, world):
    """A run with a 3 s ttl: its keys in etcd are bound to a lease; once it expires both
    replicas refuse its token with 403 run_expired, also after one replica's sweep deleted it
    from etcd (the other remembers a run that left after its expiry), and its keys leave etcd
    within seconds; then neither replica shows it."""
    a, b = fleet.a, fleet.b
    v = sval("exp")
    put_secret(a, "exp_tok", v, org="acme")
    # ttl 3: expires_at is whole seconds, so the run lives 2 to 3 s: time for B to see it.
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "exp_tok")], ttl=3)
    wait_run_known(b, run, world)
    expect(injected(world, on(run, b), v, "exp-b"), "B: not injected before expiry")
    keys = [kv for kv in fleet.etcd.range(fleet.prefix) if run.id in kv["key"]]
    assert keys, f"no key under {fleet.prefix} names {run.id}: {fleet.etcd.keys(fleet.prefix)}"
    unleased = [kv["key"] for kv in keys if not kv["lease"]]
    assert not unleased, f"run keys without a lease (a run is an etcd lease): {unleased}"

    def refusal_ok(st) -> bool:
        return st == (403, "run_expired")

    for e in (a, b):
        def refused(e=e):
            st = connect_status(on(run, e), api_host(world))
            return st if st[0] != 200 else None
        st = helpers.poll(refused, 5.0 * PROPAGATE_S,
                          f"replica :{e.proxy_port} to refuse the expired run", interval=0.05)
        assert refusal_ok(st), f"replica :{e.proxy_port} refused the expired run with {st}"
    helpers.poll(lambda: not [k for k in fleet.etcd.keys(fleet.prefix) if run.id in k], 10.0,
                 f"the keys of expired run {run.id} to leave etcd", interval=0.2)
    for e in (a, b):
        helpers.poll(lambda: api(e, "GET", f"/v1/runs/{run.id}").status == 404,
                     2.0 * PROPAGATE_S, f"replica :{e.admin_port} to forget the expired run")
        st = connect_status(on(run, e), api_host(world))
        assert refusal_ok(st), f"replica :{e.proxy_port}: expired run, gone from etcd: {st}"
    # the secret it used is still there (only the run went with its lease)
    assert "exp_tok" in secret_names(a) and "exp_tok" in secret_names(b)


def test_more_runs_expiring_at_once_than_one_transaction_takes_are_all_swept(factory, world,
                                                                            etcd):
    """Seven runs expiring in the same second, on a replica whose state.etcd.max_txn_ops is 3:
    the sweep deletes them in transactions of at most 3 (one transaction for all was refused
    whole, every second, and logged nothing), so they leave etcd long before their leases
    (lease_grace 60 s) would take them; and the open connection of one is closed at its
    expiry, whatever the sweep does."""
    prefix = f"/egressd-sweep-{pysecrets.token_hex(3)}/"
    a = start_replica(factory, make_replica(factory, world, prefix, [etcd.url], os.urandom(32),
                                            max_txn_ops=3))
    put_secret(a, "sw_tok", sval("sweep"), org="acme")
    runs = [create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "sw_tok")], ttl=3)
            for _ in range(7)]
    held = runs[0].tunnel("api.test", world.U)
    try:
        helpers.poll(lambda: helpers.closed_by_peer(held), 10.0,
                     "the connection of an expired run to be closed", interval=0.05)
    finally:
        held.close()
    helpers.poll(lambda: not any(r.id in k for r in runs for k in etcd.keys(prefix)), 15.0,
                 "every expired run to leave etcd", interval=0.2)
    assert "sweeping expired runs failed" not in a.stderr_text()
    for r in runs:
        assert connect_status(r, api_host(world)) == (403, "run_expired")


@contextlib.contextmanager
def relayed_replica(factory, world, etcd, tag: str, timeout: str):
    """Replica A on a prefix of its own, reading etcd through a GatewayRelay (which can hold
    back its watch and its reads); yields (relay, A, prefix, the fleet's master key)."""
    prefix = f"/egressd-{tag}-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)
    relay = GatewayRelay(etcd.client_port)
    try:
        a = start_replica(factory, make_replica(factory, world, prefix, [relay.url], key,
                                                timeout=timeout))
        yield relay, a, prefix, key
    finally:
        relay.close()


def test_a_read_in_flight_does_not_roll_back_what_the_watch_brought(factory, world, etcd):
    """Replica A reads the whole state again (its write lost a race: another replica changed
    the record first) while its watch runs on. The watch brings a revocation from B before
    that read's older answer lands: the older answer must not replace the newer state (the
    watch never sends the revocation again; A had served the revoked run for good)."""
    # (A's etcd timeout outlasts the held read: a read that timed out would install nothing.)
    with relayed_replica(factory, world, etcd, "race", timeout="30s") as (relay, a, prefix, key):
        b = start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key))
        put_secret(b, "race_tok", sval("race1"), org="acme")
        run = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "race_tok")])
        wait_run_known(a, run, world)
        relay.pause_watch.set()  # A's view of the secret goes stale ...
        rotate_secret(b, "race_tok", sval("race2"), org="acme")
        relay.hold_range.set()  # ... so its own rotation loses, and it reads the state again
        result = {}
        writer = threading.Thread(target=lambda: result.setdefault("r", api(
            a, "PUT", "/v1/secrets/race_tok", {"scope": {"org": "acme"}, "value": sval("race3")},
            timeout=60)), daemon=True)
        writer.start()
        assert relay.held.wait(15), "A did not read the state again"
        api_ok(b, "DELETE", f"/v1/runs/{run.id}")  # newer than the read A holds
        relay.pause_watch.clear()
        helpers.poll(lambda: connect_status(on(run, a), api_host(world)) == (403, "run_revoked"),
                     10.0, "A's watch to bring the revocation")
        relay.hold_range.clear()
        relay.release.set()  # the older read lands now
        writer.join(60)
        assert "r" in result, "A's write did not answer"
        put_secret(b, "race_other", sval("race4"), org="acme")  # moves A's watch on
        helpers.poll(lambda: "race_other" in secret_names(a), 10.0, "A to see a later write")
        assert connect_status(on(run, a), api_host(world)) == (403, "run_revoked")
        assert api_ok(a, "GET", f"/v1/runs/{run.id}")["revoked"] is True


def test_a_write_this_replica_cannot_read_back_is_not_answered_as_done(factory, world, etcd):
    """A revoke etcd took, but whose change replica A could not read back (its watch silent
    past state.etcd.timeout, and the read of the state timing out too), had been answered 200
    while A still served the run. It is 503 store_unavailable now, saying it was written; once
    A reads etcd again the run is revoked there."""
    with relayed_replica(factory, world, etcd, "unread", timeout="1s") as (relay, a, _, _):
        put_secret(a, "unread_tok", sval("unread"), org="acme")
        run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "unread_tok")])
        relay.pause_watch.set()
        relay.hold_range.set()
        r = api(a, "DELETE", f"/v1/runs/{run.id}", timeout=30)
        assert r.status == 503 and r.json["error"] == "store_unavailable", (r.status, r.body)
        assert "was written" in r.json["detail"], r.json
        relay.hold_range.clear()
        relay.release.set()
        relay.pause_watch.clear()
        helpers.poll(lambda: connect_status(on(run, a), api_host(world)) == (403, "run_revoked"),
                     15.0, "A to read the revocation")


def test_a_run_keeps_one_lease_however_often_it_is_written(fleet, world):
    """A run's record is rewritten when a pin is added or it is revoked: it keeps the lease it
    was created with (one lease per run in etcd), instead of a new one per write that left the
    old one granted, with no key, for the run's whole life (7 for a run and 5 writes)."""
    a = fleet.a
    put_secret(a, "lease_tok", sval("lease"), org="acme")
    before = fleet.etcd.leases()
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "lease_tok")],
                     ttl=3600)
    created = fleet.etcd.leases() - before
    assert len(created) == 1, created
    for i in range(3):
        api_ok(a, "POST", f"/v1/runs/{run.id}/pins",
               bearer_pin(api_host(world), "lease_tok", path_prefixes=[f"/l{i}"]))
    api_ok(a, "DELETE", f"/v1/runs/{run.id}")
    assert fleet.etcd.leases() - before == created
    leases = {kv["lease"] for kv in fleet.etcd.range(fleet.prefix) if run.id in kv["key"]}
    assert leases == created, (leases, created)


def test_a_record_that_does_not_parse_is_not_served_and_can_be_written_again(fleet, world):
    """A secret's record in etcd overwritten with something that does not parse (a hand edit,
    a format another version wrote): no replica serves the value it had before (fail closed),
    the log names the key, and the name can be written again through the API (every write
    to it had failed on a stale revision: 409 after eight full reads)."""
    a, b = fleet.a, fleet.b
    put_secret(a, "bad_tok", sval("bad1"), org="acme")
    helpers.poll(lambda: "bad_tok" in secret_names(b), 5 * PROPAGATE_S, "B to see the secret")
    [key] = [k for k in fleet.etcd.keys(fleet.prefix) if "bad_tok" in k]
    fleet.etcd.put(key, "{not json")
    for e in (a, b):
        helpers.poll(lambda e=e: "bad_tok" not in secret_names(e), 5 * PROPAGATE_S,
                     f"replica :{e.admin_port} to stop serving the unreadable record")
        assert f"etcd key {key}" in e.stderr_text()
    put_secret(b, "bad_tok", sval("bad2"), org="acme")
    for e in (a, b):
        helpers.poll(lambda e=e: "bad_tok" in secret_names(e), 5 * PROPAGATE_S,
                     f"replica :{e.admin_port} to serve the record written again")


def test_no_secret_value_reaches_etcd_or_any_output(fleet, world):
    """After puts and a rotation on both replicas, runs and traffic through both: no value (in
    clear, base64 or JSON-escaped) is in any key or value under the prefix, in etcd's files or
    log, in an admin response, or in anything either replica wrote. The names are there
    (metadata is not secret), so the dump is the real state."""
    a, b = fleet.a, fleet.b
    vals = {"nv_a": sval("nva"), "nv_b": sval("nvb"), "nv_b2": sval("nvb2")}
    put_secret(a, "nv_tok_a", vals["nv_a"], org="acme")
    put_secret(b, "nv_tok_b", vals["nv_b"], org="acme", project="web")
    rotate_secret(b, "nv_tok_b", vals["nv_b2"], org="acme", project="web")
    hdr = {"host": f"hdr.test:{world.U}", "secret": "nv_tok_b",
           "inject": {"type": "header", "name": "x-api-key", "template": "Key {secret}"}}
    run = create_run(a, world, {"org": "acme", "project": "web"},
                     [bearer_pin(api_host(world), "nv_tok_a"), hdr])
    wait_run_known(b, run, world)
    for e in (a, b):
        expect(injected(world, on(run, e), vals["nv_a"], "nv"), "not injected")
        marker = "m-nv-hdr-" + pysecrets.token_hex(3)
        c, resp = get_via(on(run, e), "hdr.test", world.U, f"/echo/{marker}")
        c.close()
        assert resp.status == 200
        got = [v_ for r in world.upstream.find(marker) for v_ in r.header("x-api-key")]
        expect(got == [f"Key {vals['nv_b2']}"], "header pin: not the rotated value")
        expect(not contains_any(resp.body, vals), "an echoed value came back unscrubbed")

    dump = fleet.etcd.dump(fleet.prefix)
    assert b"nv_tok_a" in dump and b"nv_tok_b" in dump and run.id.encode() in dump, \
        f"the etcd dump misses the fleet's records: {fleet.etcd.keys(fleet.prefix)}"
    found = contains_any(dump, vals)
    expect(not found, f"secret values in etcd under {fleet.prefix}: {found}")
    every = dict(world.secrets)  # every value put by any test of this module, and the files'
    every.update(vals)
    found = contains_any(fleet.etcd.on_disk(), every)
    expect(not found, f"secret values in etcd's files or log: {len(found)} of them")
    leaked = [what for what, body in SEEN if contains_any(body, every)]
    expect(not leaked, f"secret values in admin responses: {leaked}")
    for e in (a, b):
        leaks = e.leaks()
        expect(not leaks, f"replica :{e.admin_port} wrote secret bytes: {[p for p, _ in leaks]}")


def test_an_endpoint_that_is_down_is_skipped(factory, world, etcd):
    """Endpoints are tried in order: a replica whose first endpoint has nothing listening
    starts, writes and watches through the second (another replica sees its writes, and it
    sees the other's)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()
    prefix = f"/egressd-failover-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)
    a = start_replica(factory, make_replica(factory, world, prefix, [dead, etcd.url], key))
    b = start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key))
    put_secret(a, "from_a", sval("fa"), org="acme")
    helpers.poll(lambda: "from_a" in secret_names(b), PROPAGATE_S, "B to see A's write")
    put_secret(b, "from_b", sval("fb"), org="acme")
    helpers.poll(lambda: "from_b" in secret_names(a), PROPAGATE_S, "A to see B's write")
    for e in (a, b):
        e.stop()


def test_a_write_etcd_refuses_is_not_taken_for_an_outage(factory, world):
    """etcd answering 4xx (here a record over its --max-request-bytes) is a refusal, not an
    outage: 500 store_failed saying etcd refused it (not 503 store_unavailable, and not
    retried on the next endpoint); the replica keeps serving writes that fit."""
    small = Etcd(require_etcd_bin(), world.new_dir("etcd-small-"),
                 ["--max-request-bytes", "4096"]).start()
    try:
        a = start_replica(factory, make_replica(factory, world, "/egressd-refuse/",
                                                [small.url, small.url], os.urandom(32)))
        big = sval("big") + "x" * 8000
        a.secrets[f"cp:big:{fp(big)}"] = big
        r = api(a, "POST", "/v1/secrets", {"name": "big", "scope": {"org": "acme"},
                                           "value": big})
        assert r.status == 500, (r.status, r.body[:300])
        j = r.json
        assert j["error"] == "store_failed", j
        assert j["detail"].startswith("etcd refused the request: "), j["detail"]
        assert "too large" in j["detail"], j["detail"]
        assert "big" not in secret_names(a)
        put_secret(a, "fits", sval("fits"), org="acme")
        assert "fits" in secret_names(a)
        a.stop()
    finally:
        small.stop()


def test_a_sweep_that_cannot_write_says_so_and_backs_off(factory, world):
    """An expired run to sweep and an etcd that answers nothing: each failed sweep is logged
    with the wait before the next (2, 4 ... s: a sweep holds the admin thread, which answers
    the probes, for state.etcd.timeout), the run's connection is closed at its expiry all the
    same, and once etcd answers again the sweep goes through and says so."""
    stalled = Etcd(require_etcd_bin(), world.new_dir("etcd-sweep-")).start()
    try:
        a = start_replica(factory, make_replica(
            factory, world, "/egressd-sweep-stall/", [stalled.url], os.urandom(32),
            timeout="300ms"))
        put_secret(a, "st_tok", sval("stall"), org="acme")
        run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "st_tok")],
                         ttl=2)
        held = run.tunnel("api.test", world.U)
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            helpers.poll(lambda: helpers.closed_by_peer(held), 10.0,
                         "the expired run's connection to be closed", interval=0.05)
            helpers.poll(lambda: "sweeping expired runs failed (next try in 4 s)"
                         in a.stderr_text(), 15.0, "the second failed sweep logged")
            log = a.stderr_text()
            assert log.count("sweeping expired runs failed") == 2, log[-2000:]
            assert "(next try in 2 s)" in log
            assert api(a, "GET", "/healthz", token=None).status == 200
        finally:
            held.close()
            os.kill(stalled.proc.pid, signal.SIGCONT)
        helpers.poll(lambda: "sweeping expired runs works again" in a.stderr_text(), 15.0,
                     "the sweep to go through after etcd resumed")
        # (The write a stalled sweep sent may land when etcd resumes: the run is gone then.)
        helpers.poll(lambda: api(a, "GET", f"/v1/runs/{run.id}").status == 404, 5.0,
                     "the swept run to be gone")
        a.stop()
    finally:
        stalled.stop()


def test_etcd_names_are_resolved_by_the_resolver_and_a_silent_dns_holds_no_write(factory,
                                                                                world, etcd):
    """An endpoint named by host (http://etcd.test:PORT) is looked up with resolver.servers,
    as upstream names are. When that DNS stops answering, a write still goes through on the
    endpoint's last answer, well within state.etcd.timeout (a lookup that hung had held
    every call for the system resolver's whole timeout, and the calls behind it)."""
    dns = DnsServer(scripts={"etcd.test": fixed("127.0.0.1")})
    try:
        def with_dns(cfg: dict):
            cfg["resolver"]["servers"] = [f"127.0.0.1:{dns.port}"]
        a = start_replica(factory, make_replica(
            factory, world, f"/egressd-dns-{pysecrets.token_hex(3)}/",
            [f"http://etcd.test:{etcd.client_port}"], os.urandom(32), then=with_dns,
            timeout="2s"))
        put_secret(a, "dns_tok", sval("dns1"), org="acme")
        assert any(q.name == "etcd.test" for q in dns.log), "etcd.test was not looked up"
        dns.mute = True
        t0 = time.monotonic()
        r = api(a, "POST", "/v1/secrets", {"name": "dns_tok2", "scope": {"org": "acme"},
                                           "value": sval("dns2")}, timeout=30)
        took = time.monotonic() - t0
        assert r.status == 201, (r.status, r.body[:300])
        assert took < 6.0, f"a write with a silent DNS took {took:.1f} s"
    finally:
        dns.close()


def test_an_etcd_endpoint_with_a_bad_port_is_refused_at_start(factory, world, etcd):
    """An endpoint whose port is empty, 0 or out of range is an error at start naming
    state.etcd.endpoints (an empty one had thrown inside the watch, which ended unseen: the
    replica served a state nobody updated)."""
    for bad in ("http://127.0.0.1:", "http://127.0.0.1:0", "http://127.0.0.1:99999999999"):
        e = make_replica(factory, world, "/egressd-port/", [etcd.url, bad], os.urandom(32))
        with pytest.raises(AssertionError):
            e.start()
        log = e.stderr_text()
        assert "state.etcd.endpoints" in log and "a number from 1 to 65535" in log, log[-800:]


def test_state_etcd_timeout_bounds_a_write_to_a_stalled_etcd(factory, world):
    """An etcd that accepts connections but answers nothing (SIGSTOP: the kernel still
    completes the handshake) holds a write for state.etcd.timeout, here 400 ms, not the 5 s
    default: the write answers 503 store_unavailable naming the endpoint well before 5 s, the
    replica keeps serving, and once etcd runs again writes land."""
    stalled = Etcd(require_etcd_bin(), world.new_dir("etcd-stall-")).start()
    try:
        a = start_replica(factory, make_replica(
            factory, world, "/egressd-stall/", [stalled.url], os.urandom(32), timeout="400ms"))
        put_secret(a, "before", sval("before"), org="acme")
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            r = api(a, "POST", "/v1/secrets", {"name": "stalled", "scope": {"org": "acme"},
                                               "value": sval("stalled")}, timeout=30)
            took = time.monotonic() - t0
            assert r.status == 503, (r.status, r.body[:300])
            assert r.json["error"] == "store_unavailable", r.json
            assert stalled.url.removeprefix("http://") in r.json["detail"], r.json
            assert took < 3.0, f"the write to a stalled etcd took {took:.1f}s (timeout 400ms)"
            assert api(a, "GET", "/healthz", token=None).status == 200
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
        n = [0]

        def write_lands():
            n[0] += 1
            r = api(a, "POST", "/v1/secrets", {"name": f"after_{n[0]}", "scope": {"org": "acme"},
                                               "value": sval("after")}, timeout=30)
            return r.status == 201
        helpers.poll(write_lands, 15.0, "a write after etcd resumed", interval=0.25)
        a.stop()
    finally:
        stalled.stop()


def test_the_probes_answer_at_once_while_an_api_write_waits_on_a_stalled_etcd(factory, world):
    """A write held by an etcd that answers nothing (state.etcd.timeout 4 s) runs on the
    control thread: meanwhile /healthz, /readyz and /metrics answer from the admin thread at
    once (they had waited behind the write, and a kubelet whose liveness probe timed out
    restarts a healthy sidecar), and the proxy serves; the write still ends with 503."""
    stalled = Etcd(require_etcd_bin(), world.new_dir("etcd-probe-")).start()
    try:
        a = start_replica(factory, make_replica(
            factory, world, "/egressd-probe/", [stalled.url], os.urandom(32), timeout="4s"))
        value = sval("probe")
        put_secret(a, "pr_tok", value, org="acme")
        run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "pr_tok")])
        os.kill(stalled.proc.pid, signal.SIGSTOP)
        write: dict = {}

        def slow_write():
            t0 = time.monotonic()
            write["reply"] = api(a, "POST", "/v1/secrets",
                                 {"name": "pr_held", "scope": {"org": "acme"},
                                  "value": sval("held")}, timeout=30)
            write["took"] = time.monotonic() - t0
        t = threading.Thread(target=slow_write)
        try:
            t.start()
            time.sleep(0.5)  # the write is on its way to the stalled etcd
            assert "reply" not in write, "the write did not wait on the stalled etcd"
            for path in ("/healthz", "/readyz", "/metrics"):
                t0 = time.monotonic()
                r = api(a, "GET", path, token=None, timeout=30)
                took = time.monotonic() - t0
                assert r.status == 200, (path, r.status)
                assert took < 1.0, f"{path} took {took:.2f} s while a write waited on etcd"
            assert "reply" not in write, "the write ended before the probes were answered"
            assert injected(world, run, value, "probe-stall")
            t.join(30)
            assert write["reply"].status == 503, (write["reply"].status,
                                                  write["reply"].body[:300])
            assert write["took"] >= 3.0, write["took"]
        finally:
            os.kill(stalled.proc.pid, signal.SIGCONT)
            t.join(30)
        a.stop()
    finally:
        stalled.stop()


def test_state_etcd_lease_grace_sets_how_long_a_run_outlives_its_expiry(fleet, factory, world):
    """A run's keys are on a lease granted for the run's remaining life plus
    state.etcd.lease_grace: 60 s by default (replica A), 5 s on a replica configured so."""
    with open(fleet.a.config["keys"]["master_key_file"], "rb") as f:
        key = f.read()
    short = start_replica(factory, make_replica(factory, world, fleet.prefix,
                                                [fleet.etcd.url], key, lease_grace="5s"))
    for e, grace in ((fleet.a, 60), (short, 5)):
        run = create_run(e, world, {"org": "acme"}, [], ttl=30)
        leases = {kv["lease"] for kv in fleet.etcd.range(fleet.prefix) if run.id in kv["key"]}
        assert len(leases) == 1 and 0 not in leases, leases
        granted = fleet.etcd.lease_granted_ttl(leases.pop())
        # expires_at is whole seconds: the run has 29 to 30 s left when its lease is granted
        assert 28 + grace <= granted <= 31 + grace, (e.admin_port, grace, granted)
    short.stop()


def test_a_rotation_larger_than_state_etcd_max_txn_ops_goes_in_several_transactions(
        factory, world, etcd):
    """POST /v1/keys/rotate (through keys.kms_command, the fleet's way) re-wraps every record
    in etcd transactions of at most state.etcd.max_txn_ops records each: with more records
    than that it still rotates them all (each transaction one etcd revision, none larger than
    the bound), and another replica rotates the same state again; both keep injecting."""
    kek, kms = kms_stub(world, "kms-")

    def with_kms(cfg: dict):
        cfg["keys"]["kms_command"] = kms
    prefix = f"/egressd-txn-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)
    a = start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key,
                                            then=with_kms, max_txn_ops=3))
    b = start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key,
                                            then=with_kms))
    values = {f"txn_{i}": sval(f"txn{i}") for i in range(4)}
    for name, v in values.items():
        put_secret(a, name, v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "txn_0")])
    before = etcd.dump(prefix)
    revision_before = etcd.max_mod_revision(prefix)
    r = api(a, "POST", "/v1/keys/rotate", timeout=30)
    # four secrets and the run's CA key, in two transactions of at most three
    assert r.status == 200 and r.json["rewrapped"] == 5, (r.status, r.body[:300])
    assert etcd.dump(prefix) != before
    revisions = {}
    for kv in etcd._post("/v3/kv/range", {"key": b64(prefix.encode()),
                                          "range_end": b64(prefix_end(prefix.encode())),
                                          "keys_only": True}).get("kvs", []):
        rev = int(kv["mod_revision"])
        if rev > revision_before:
            revisions[rev] = revisions.get(rev, 0) + 1
    assert sum(revisions.values()) == 5 and max(revisions.values()) <= 3, revisions
    put_secret(a, "after_rotation", sval("after"), org="acme")
    wait_run_known(b, run, world)
    helpers.poll(lambda: "after_rotation" in secret_names(b), PROPAGATE_S,
                 "B to list the secret put on A after the rotation")
    r = api(b, "POST", "/v1/keys/rotate", timeout=30)
    # five secrets (four, and the one put after the first rotation) and the run's CA key
    assert r.status == 200 and r.json["rewrapped"] == 6, (r.status, r.body[:300])
    for e, tag in ((a, "txn-a"), (b, "txn-b")):
        helpers.poll(lambda e=e, tag=tag: injected(world, on(run, e), values["txn_0"], tag),
                     5.0 * PROPAGATE_S, f"replica :{e.proxy_port} to inject after the rotation",
                     interval=0.2)
    for e in (a, b):
        e.stop()


def test_an_unreachable_etcd_is_a_clear_start_error(factory, world):
    """An endpoint where nothing listens: egressd does not serve on a state it cannot load; it
    exits non-zero within seconds and says which key to fix."""
    e = make_replica(factory, world, f"/egressd-test-down-{pysecrets.token_hex(3)}/",
                     [f"http://127.0.0.1:{world.closed_port}"], os.urandom(32))
    stderr = helpers.start_fails(e)
    assert "state.etcd.endpoints" in stderr, f"stderr does not name the key: {stderr[-2000:]!r}"


# ---------------------------------------------------------------------------------------------
# TLS to etcd


@pytest.fixture(scope="module")
def etcd_tls(world):
    """An etcd on https:// that requires a client certificate (--client-cert-auth), its
    certificates from the test CA; the client certificate egressd presents; and one from a CA
    etcd does not trust."""
    d = world.pki.dir
    upstream.make_leaf(d, "testca", "etcd-server", ["localhost"], "serverAuth,clientAuth",
                       ips=False)
    upstream.make_leaf(d, "testca", "etcd-client", ["egressd"], "clientAuth")
    upstream.make_leaf(d, "untrustedca", "etcd-stranger", ["egressd"], "clientAuth")
    j = lambda n: os.path.join(d, n)  # noqa: E731
    tls = EtcdTls(world.pki.ca, j("etcd-server.pem"), j("etcd-server.key"),
                  j("etcd-client.pem"), j("etcd-client.key"))
    e = Etcd(require_etcd_bin(), world.new_dir("etcd-tls-"), tls=tls).start()
    yield e
    e.stop()


def tls_keys(world, cert: str = "etcd-client") -> dict:
    d = world.pki.dir
    return {"ca_file": world.pki.ca, "cert_file": os.path.join(d, f"{cert}.pem"),
            "key_file": os.path.join(d, f"{cert}.key")}


def test_a_fleet_over_tls_with_client_certificates(factory, world, etcd_tls):
    """Two replicas reach an etcd that speaks only TLS and requires a client certificate:
    they verify its certificate (state.etcd.ca_file), present theirs (cert_file, key_file),
    and share secrets and runs as over http:// (a run made on A injects on B). The port
    refuses cleartext, so nothing went over it in the clear."""
    assert etcd_tls.url.startswith("https://")
    with pytest.raises(OSError):  # cleartext HTTP on the TLS port gets no answer
        urllib.request.urlopen("http://" + etcd_tls.url.removeprefix("https://") + "/health",
                               timeout=2).read()
    prefix = f"/egressd-tls-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)

    def debug_log(cfg: dict):
        cfg.setdefault("log", {})["level"] = "debug"
    a = start_replica(factory, make_replica(factory, world, prefix, [etcd_tls.url], key,
                                            then=debug_log, **tls_keys(world)))
    b = start_replica(factory, make_replica(factory, world, prefix, [etcd_tls.url], key,
                                            **tls_keys(world)))
    v = sval("tls")
    put_secret(a, "tls_tok", v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "tls_tok")])
    wait_run_known(b, run, world)
    expect(injected(world, on(run, b), v, "tls-b"), "B: not injected for a run made on A")
    assert any(run.id in k for k in etcd_tls.keys(prefix)), etcd_tls.keys(prefix)
    # each call is a connection of its own: after the first, they resume the TLS session
    log = a.stderr_text()
    assert "full handshake" in log and "resumed" in log, \
        [line for line in log.splitlines() if "etcd: https" in line][:6]
    for e in (a, b):
        e.stop()


FLEET_EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs",
                             "fleet.yaml")


def test_the_fleet_example_config_runs_a_fleet(factory, world, etcd_tls):
    """configs/fleet.yaml as shipped, with only what names this machine replaced (listen
    ports, admin token, master key and audit files, the test resolver and upstream CA, the
    loopback network and ports the test upstream uses, the etcd endpoint and its certificate
    files), runs two replicas over TLS to etcd that serve a run made on the other."""
    with open(FLEET_EXAMPLE) as f:
        example = yaml.safe_load(f)
    assert example["state"]["backend"] == "etcd"
    assert all(u.startswith("https://") for u in example["state"]["etcd"]["endpoints"])
    assert example["runs"] == []

    def as_example(cfg: dict):
        local = {k: cfg[k] for k in ("listen", "admin", "keys", "audit", "resolver", "upstream")}
        reach = {k: cfg["policy"][k] for k in ("allow_networks", "allowed_ports")}
        etcd = cfg["state"]["etcd"]
        cfg.clear()
        cfg.update(copy.deepcopy(example))
        cfg.update(local)
        cfg["policy"].update(reach)
        for k in ("endpoints", "prefix", "ca_file", "cert_file", "key_file"):
            cfg["state"]["etcd"][k] = etcd[k]
    prefix = f"/egressd-example-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)
    a, b = (start_replica(factory, make_replica(factory, world, prefix, [etcd_tls.url], key,
                                                then=as_example, **tls_keys(world)))
            for _ in range(2))
    assert a.config["state"]["etcd"]["timeout"] == example["state"]["etcd"]["timeout"]
    v = sval("example")
    put_secret(a, "ex_tok", v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "ex_tok")])
    wait_run_known(b, run, world)
    expect(injected(world, on(run, b), v, "example-b"), "B: not injected for a run made on A")
    for e in (a, b):
        e.stop()


@pytest.mark.parametrize("case", ["untrusted_server", "wrong_name", "no_client_cert",
                                  "untrusted_client"])
def test_etcd_tls_failures_are_clear_start_errors(factory, world, etcd_tls, case):
    """A TLS setup that cannot work is an exit at start naming the key, never a replica
    serving without its state: etcd's certificate from a CA state.etcd.ca_file does not hold;
    an endpoint (127.0.0.1) that etcd's certificate (localhost only) does not name; no client
    certificate, or one from a CA etcd does not trust, for an etcd that requires one."""
    keys = tls_keys(world)
    url = etcd_tls.url
    if case == "untrusted_server":
        keys["ca_file"] = world.pki.untrusted_ca
    elif case == "wrong_name":
        url = url.replace("localhost", "127.0.0.1")
    elif case == "no_client_cert":
        del keys["cert_file"], keys["key_file"]
    else:
        keys.update(tls_keys(world, "etcd-stranger"))
    e = make_replica(factory, world, f"/egressd-tls-bad-{pysecrets.token_hex(3)}/", [url],
                     os.urandom(32), **keys)
    stderr = helpers.start_fails(e)
    assert "state.etcd.endpoints" in stderr, stderr[-2000:]
    assert url in stderr, stderr[-2000:]
    if case in ("untrusted_server", "wrong_name"):
        assert "TLS handshake" in stderr and "certificate verify failed" in stderr, \
            stderr[-2000:]
    if case == "wrong_name":
        assert "IP address mismatch" in stderr, stderr[-2000:]
