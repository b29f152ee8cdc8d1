"""A fleet whose etcd is not the one it read: restored from a snapshot (its revision goes back),
wiped (a new, empty cluster), or out of reach (a partition); and two replicas sweeping the same
expired runs.

A replica's view of the state only moves forward with etcd's revision. After a restore or a
wipe etcd's revision is below the one the replica holds: its whole-state read is the truth
again, however old its revision, or the replica serves its old state for good (a revocation
answered 200 and never enforced, new writes never shown). A replica that cannot reach etcd
serves what it last saw; state.etcd.max_staleness bounds how long /readyz says it is ready.

Each test has an etcd of its own (these tests replace its data), loopback only, temp data.
"""
from __future__ import annotations

import os
import re
import secrets as pysecrets
import time

import pytest

import helpers
from cp_helpers import api, api_ok, bearer_pin, create_run, put_secret
from etcd_helpers import CuttableRelay, Etcd, GatewayRelay, require_etcd_bin
from test_fleet import (PROPAGATE_S, api_host, connect_status, make_replica, on, secret_names,
                        start_replica, sval, wait_run_known)

# How long a replica may take to notice etcd came back with another history and read it
# again: its watch breaks when etcd stops, resyncs with a backoff of up to 2 s, then one read
# and the runtime rebuild. A sanitizer build runs several times slower.
RECOVER_S = 10.0 * (2 if helpers.SANITIZER else 1)


@pytest.fixture
def etcd(world):
    """An etcd of the test's own: the tests restore and wipe it."""
    e = Etcd(require_etcd_bin(), world.new_dir("etcd-hist-")).start()
    yield e
    e.stop()


def two_replicas(factory, world, a_endpoints: list[str], b_endpoints: list[str], **etcd_keys):
    prefix = f"/egressd-hist-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)
    a = start_replica(factory, make_replica(factory, world, prefix, a_endpoints, key,
                                            **etcd_keys))
    b = start_replica(factory, make_replica(factory, world, prefix, b_endpoints, key,
                                            **etcd_keys))
    return a, b, prefix


def refused_everywhere(run, replicas, world, bound: float, why: str):
    for e in replicas:
        helpers.poll(lambda e=e: connect_status(on(run, e), api_host(world))[0] != 200, bound,
                     f"replica :{e.proxy_port} to refuse {why}", interval=0.05)


def test_a_revocation_after_etcd_was_restored_from_a_snapshot_is_enforced(factory, world, etcd):
    """A snapshot is taken, writes follow, and etcd is restored from the snapshot: its revision
    goes back below the replicas'. The replicas serve etcd's state as restored (the writes
    after the snapshot are gone), a revocation made then is enforced on both, and a secret
    written then shows on both. Before: each replica threw away the older read and watched
    from its old revision; the revocation answered 200 and the run kept working."""
    a, b, prefix = two_replicas(factory, world, [etcd.url], [etcd.url])
    put_secret(a, "rs_tok", sval("rs"), org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "rs_tok")])
    wait_run_known(b, run, world)
    backup = os.path.join(etcd.workdir, "backup.db")
    etcd.snapshot_save(backup)
    for i in range(10):  # writes after the backup: the replicas' revision moves past it
        put_secret(a, f"after{i}", sval("after"), org="acme")
    helpers.poll(lambda: "after9" in secret_names(b), PROPAGATE_S, "B to see the last write")

    etcd.restore(backup)

    # The writes after the snapshot are gone from etcd, so from both replicas.
    for e in (a, b):
        helpers.poll(lambda e=e: "after0" not in secret_names(e), RECOVER_S,
                     f"replica :{e.admin_port} to serve the restored state", interval=0.1)
    r = api(a, "DELETE", f"/v1/runs/{run.id}")
    assert r.status == 200, f"revoke after the restore: {r.status} {r.body[:300]!r}"
    refused_everywhere(run, (a, b), world, 2 * PROPAGATE_S, "the run revoked after the restore")
    for e in (a, b):
        assert api_ok(e, "GET", f"/v1/runs/{run.id}")["revoked"] is True
    put_secret(b, "restored_new", sval("rn"), org="acme")
    helpers.poll(lambda: "restored_new" in secret_names(a), 2 * PROPAGATE_S,
                 "A to show a secret written on B after the restore")
    assert "etcd was restored from a backup, wiped or replaced" in a.stderr_text()


def test_a_wiped_etcd_is_served_as_it_now_is(factory, world, etcd):
    """etcd loses its data (a new, empty cluster on the same address): the replicas drop the
    state etcd no longer holds (the run is refused: etcd is the truth, fail closed), and a
    secret written then shows on both. Before: both kept their old state, and a write
    answered 201 but never showed on the other replica."""
    a, b, prefix = two_replicas(factory, world, [etcd.url], [etcd.url])
    put_secret(a, "wp_tok", sval("wp"), org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "wp_tok")])
    wait_run_known(b, run, world)
    for i in range(10):
        put_secret(a, f"pad{i}", sval("pad"), org="acme")
    helpers.poll(lambda: "pad9" in secret_names(b), PROPAGATE_S, "B to see the last write")

    etcd.wipe()

    refused_everywhere(run, (a, b), world, RECOVER_S, "a run etcd no longer holds")
    for e in (a, b):
        helpers.poll(lambda e=e: secret_names(e) == [], RECOVER_S,
                     f"replica :{e.admin_port} to list etcd's (empty) state", interval=0.1)
    put_secret(a, "after_wipe", sval("aw"), org="acme")
    assert "after_wipe" in secret_names(a), "A does not show its own write"
    helpers.poll(lambda: "after_wipe" in secret_names(b), 2 * PROPAGATE_S,
                 "B to show a secret written on A after the wipe")
    assert [k for k in etcd.keys(prefix) if "/secrets/" in k], "the write is not in etcd"


def test_a_replica_cut_off_from_etcd_stops_being_ready_after_max_staleness(factory, world,
                                                                          etcd):
    """Replica A reaches etcd through a relay that is cut (a partition); B revokes a run. A
    cannot know and serves it, but its /readyz answers 503 naming the stale state once
    state.etcd.max_staleness has passed (a Service stops sending it new connections), and
    /metrics shows how long it has been; healed, A enforces the revocation and is ready
    again. B, in step all along, stays ready. Before: A said ready for good."""
    relay = CuttableRelay(etcd.client_port)
    try:
        a, b, prefix = two_replicas(factory, world, [relay.url], [etcd.url], timeout="1s",
                                    max_staleness="3s")
        put_secret(b, "pt_tok", sval("pt"), org="acme")
        run = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "pt_tok")])
        wait_run_known(a, run, world)
        for e in (a, b):
            assert e.admin_get("/readyz")[0] == 200
            m = re.search(rb"^egressd_state_sync_age_seconds ([0-9.e+-]+)$",
                          e.admin_get("/metrics")[1], re.M)
            assert m and float(m.group(1)) < 3.0, m

        relay.cut()
        assert api(b, "DELETE", f"/v1/runs/{run.id}").status == 200
        t0 = time.monotonic()
        got = helpers.poll(lambda: (lambda r: r if r and r[0] == 503 else None)(
                           a.admin_get("/readyz")), 10.0, "A's /readyz to answer 503",
                           interval=0.1)
        waited = time.monotonic() - t0
        assert b"state stale" in got[1] and b"max_staleness" in got[1], got
        assert waited > 1.0, f"A unready {waited:.1f} s after the cut, before max_staleness"
        age = float(re.search(rb"^egressd_state_sync_age_seconds ([0-9.e+-]+)$",
                              a.admin_get("/metrics")[1], re.M).group(1))
        assert age > 3.0, age
        assert b.admin_get("/readyz")[0] == 200, "B (in step with etcd) is not ready"

        relay.restore()
        refused_everywhere(run, (a,), world, RECOVER_S, "the run revoked while cut off")
        helpers.poll(lambda: a.admin_get("/readyz")[0] == 200, RECOVER_S,
                     "A's /readyz to answer 200 again")
    finally:
        relay.close()


def test_max_staleness_is_checked(factory):
    """state.etcd.max_staleness: null or a duration, at least 3 s and twice state.etcd.timeout;
    --check names the key."""
    def etcd_cfg(**keys):
        return lambda c: c["state"].update(
            {"backend": "etcd", "etcd": {"endpoints": ["http://127.0.0.1:2379"], **keys}})
    for keys in ({"max_staleness": "30s"}, {"max_staleness": None}):
        r = factory.make(etcd_cfg(**keys)).check()
        assert r.returncode == 0, (keys, r.stderr)
    for keys in ({"max_staleness": "1s"}, {"max_staleness": "8s", "timeout": "5s"},
                 {"max_staleness": "soon"}, {"max_staleness": "48h"}):
        r = factory.make(etcd_cfg(**keys)).check()
        assert r.returncode != 0, f"--check accepted {keys}"
        assert "state.etcd.max_staleness" in r.stderr, (keys, r.stderr)


def test_two_replicas_sweeping_the_same_expired_runs_both_succeed(factory, world, etcd):
    """Three runs expire while B's view lags (its watch held back, its writes slowed): A sweeps
    them first, and B's sweep of the same runs finds them gone. That is not a failure: B's
    sweep counts them as swept, logs no failure and does not back off. Before: B's whole
    batch failed on not_found and the sweep backed off."""
    relay = GatewayRelay(etcd.client_port)
    try:
        a, b, prefix = two_replicas(factory, world, [etcd.url], [relay.url])
        runs = [create_run(a, world, {"org": "acme"}, [], ttl=3) for _ in range(3)]
        keep = create_run(a, world, {"org": "acme"}, [], ttl=600)
        for r in runs:
            helpers.poll(lambda r=r: api(b, "GET", f"/v1/runs/{r.id}").status == 200,
                         PROPAGATE_S, "the run on B")
        # B's view keeps the runs (its watch is held) and its writes reach etcd late, so
        # whichever replica's sweep comes first, A's deletion lands before B's.
        relay.pause_watch.set()
        relay.delay_txn = 1.5
        helpers.poll(lambda: not any(r.id in k for r in runs for k in etcd.keys(prefix)), 10.0,
                     "A to sweep the expired runs", interval=0.1)
        # B reads the state again when its transaction loses (the runs are gone): its sweep
        # has come back then.
        helpers.poll(lambda: all(api(b, "GET", f"/v1/runs/{r.id}").status == 404 for r in runs),
                     10.0, "B's sweep to have come back", interval=0.1)
        time.sleep(0.5)
        relay.pause_watch.clear()
        relay.delay_txn = 0
        log = b.stderr_text()
        assert "sweeping expired runs failed" not in log, log[-2000:]
        for e in (a, b):
            helpers.poll(lambda e=e: all(api(e, "GET", f"/v1/runs/{r.id}").status == 404
                                         for r in runs), 5.0,
                         f"replica :{e.admin_port} to forget the swept runs")
            assert api(e, "GET", f"/v1/runs/{keep.id}").status == 200
    finally:
        relay.close()
