"""Who decides where a secret goes: run records are authenticated (credstore/run_mac.h), so
whoever can write the state (etcd's prefix, or state.json) but holds no master key cannot
send a secret anywhere; and `keys rotate` of a state larger than one etcd request goes through
in bounded transactions. Two replicas on a real etcd (test_fleet.py's helpers)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets as pysecrets

import pytest

import helpers
from cp_helpers import (api, api_ok, bearer_pin, cp_mutate, create_run, get_via, kms_stub,
                        put_secret, seen_auth, state_dir)
from test_fleet import (PROPAGATE_S, api_host, connect_status, injected,
                        make_replica, on, sval, start_replica, wait_run_known)
from etcd_helpers import Etcd, require_etcd_bin


@pytest.fixture(scope="module")
def etcd(world):
    e = Etcd(require_etcd_bin(), world.new_dir("etcd-")).start()
    yield e
    e.stop()


def kms_fleet(factory, world, etcd, n: int = 2):
    """n replicas on a fresh prefix sharing one KMS (keys.kms_command: the fleet's way to
    rotate); returns (replicas, prefix, with_kms) to start more of the same."""
    kek, kms = kms_stub(world, "kms-")

    def with_kms(cfg: dict):
        cfg["keys"]["kms_command"] = kms
    prefix = f"/egressd-int-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)

    def replica():
        return start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key,
                                                   then=with_kms))
    return [replica() for _ in range(n)], prefix, replica


def record(etcd: Etcd, prefix: str, run_id: str) -> dict:
    [kv] = [kv for kv in etcd.range(prefix) if kv["key"] == f"{prefix}runs/{run_id}"]
    return json.loads(kv["value"])


def not_served(e: helpers.Egressd, run, world) -> bool:
    return connect_status(on(run, e), api_host(world))[0] == 407


def test_a_run_record_edited_in_etcd_sends_the_secret_nowhere(factory, world, etcd):
    """Someone who can write etcd but has no master key puts a run record back with the hash
    of a token of their own and a pin sending the victim's secret to a host of their choice:
    no replica serves the edited record (407 for their token and the run's own, nothing
    reaches the upstream), each says why in its log (no secret bytes), a pin cannot be added
    to it (that would sign it), and a new run is served as usual."""
    (a, b), prefix, _ = kms_fleet(factory, world, etcd)
    v = sval("victim")
    put_secret(a, "victim_tok", v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "victim_tok")])
    wait_run_known(b, run, world)
    rec = record(etcd, prefix, run.id)
    assert len(rec["mac"]) == 64
    mytoken = "attacker-token-" + pysecrets.token_hex(4)
    rec["token_sha256"] = hashlib.sha256(mytoken.encode()).hexdigest()
    pin = dict(rec["pins"][0], id="pin_evil", host=f"other.test:{world.U}")
    rec["pins"].append(pin)
    etcd.put(f"{prefix}runs/{run.id}", json.dumps(rec))
    for e in (a, b):
        helpers.poll(lambda e=e: not_served(e, run, world), 5 * PROPAGATE_S,
                     f"replica :{e.proxy_port} to stop serving the edited record")
        c, resp = helpers.proxy_connect(e.proxy_port, f"other.test:{world.U}",
                                        helpers.basic_auth(run.id, mytoken))
        c.close()
        assert resp.status == 407, (resp.status, resp.egress_reason)
        assert f"run {run.id}: not served: its record does not verify" in e.stderr_text()
    r = api(b, "POST", f"/v1/runs/{run.id}/pins", bearer_pin(f"basic.test:{world.U}",
                                                             "victim_tok"))
    assert r.status == 409 and "does not verify" in r.json["detail"], (r.status, r.body[:300])
    assert record(etcd, prefix, run.id) == rec, "the refused pin changed the record"
    fresh = create_run(b, world, {"org": "acme"}, [bearer_pin(api_host(world), "victim_tok")])
    wait_run_known(a, fresh, world)
    assert injected(world, on(fresh, a), v, "int-fresh")
    for e in (a, b):
        assert not e.leaks(), f"replica :{e.admin_port} wrote secret bytes"


def test_a_run_record_copied_under_another_id_or_without_mac_is_not_served(
        factory, world, etcd):
    """A record copied to a key of its own with another id (a run made without the admin
    API), and a record with its MAC removed (what an egressd from before MACs wrote: not
    accepted, or anyone could strip the MAC off a record to have it accepted) are not
    served; the untouched run is."""
    (a, b), prefix, _ = kms_fleet(factory, world, etcd)
    v = sval("copy")
    put_secret(a, "copy_tok", v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "copy_tok")])
    other = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "copy_tok")])
    wait_run_known(b, run, world)
    wait_run_known(b, other, world)
    forged = dict(record(etcd, prefix, run.id), id="run_00forged00")
    etcd.put(f"{prefix}runs/run_00forged00", json.dumps(forged))
    stripped = record(etcd, prefix, other.id)
    del stripped["mac"]
    etcd.put(f"{prefix}runs/{other.id}", json.dumps(stripped))
    copy = dataclasses.replace(run, id="run_00forged00")
    for e in (a, b):
        helpers.poll(lambda e=e: not_served(e, other, world), 5 * PROPAGATE_S,
                     f"replica :{e.proxy_port} to stop serving the record without a MAC")
        helpers.poll(lambda e=e: "run run_00forged00: not served" in e.stderr_text(),
                     5 * PROPAGATE_S, f"replica :{e.proxy_port} to refuse the copied record")
        assert not_served(e, on(copy, e), world)
        assert f"run {other.id}: not served: its record has no MAC" in e.stderr_text()
        assert injected(world, on(run, e), v, "int-copy")


def test_keys_rotate_keeps_every_run_record_verifiable(factory, world, etcd):
    """After `keys rotate` (KMS) the records keep their MACs (the CA keys' DEKs are rewrapped,
    not changed): a replica started afterwards verifies and serves the run, and a pin added
    after the rotation is signed and served everywhere."""
    (a, b), prefix, replica = kms_fleet(factory, world, etcd)
    v = sval("rot")
    put_secret(a, "rot_tok", v, org="acme")
    run = create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "rot_tok")],
                     allow=[f"hdr.test:{world.U}"])  # its CA may certify the pin added later
    wait_run_known(b, run, world)
    mac = record(etcd, prefix, run.id)["mac"]
    r = api(b, "POST", "/v1/keys/rotate", timeout=60)
    assert r.status == 200 and r.json["rewrapped"] == 2 and not r.json["skipped"], r.body[:300]
    assert record(etcd, prefix, run.id)["mac"] == mac
    c = replica()
    wait_run_known(c, run, world, timeout=5 * PROPAGATE_S)
    api_ok(b, "POST", f"/v1/runs/{run.id}/pins", bearer_pin(f"hdr.test:{world.U}", "rot_tok"))
    for e, tag in ((a, "int-ra"), (b, "int-rb"), (c, "int-rc")):
        assert injected(world, on(run, e), v, tag)

        def hdr_injected(e=e, tag=tag):
            marker = f"m-{tag}-h-" + pysecrets.token_hex(3)
            conn, resp = get_via(on(run, e), "hdr.test", world.U, f"/echo/{marker}")
            conn.close()
            return resp.status == 200 and seen_auth(world.upstream, marker) == [f"Bearer {v}"]
        helpers.poll(hdr_injected, 5 * PROPAGATE_S, f"replica :{e.proxy_port}: the new pin")


def test_a_rotation_larger_than_one_etcd_request_goes_through(factory, world, etcd):
    """100 secrets of 16 KB and two runs: about 2.2 MB of records, over etcd's default
    --max-request-bytes (1.5 MiB) for one transaction. `keys rotate` writes them in bounded
    transactions: 200, every record rewrapped, and the runs still inject on both replicas."""
    (a, b), prefix, _ = kms_fleet(factory, world, etcd)
    for i in range(100):
        put_secret(a, f"big{i}", helpers.secret(pysecrets.token_hex(8000)), org="acme")
    v = sval("big")
    put_secret(a, "big_tok", v, org="acme")
    runs = [create_run(a, world, {"org": "acme"}, [bearer_pin(api_host(world), "big_tok")])
            for _ in range(2)]
    assert sum(len(kv["value"]) for kv in etcd.range(prefix)) > 2 * 1024 * 1024
    r = api(a, "POST", "/v1/keys/rotate", timeout=120)
    assert r.status == 200, (r.status, r.body[:300])
    assert r.json["rewrapped"] == 103 and not r.json["skipped"], r.body[:300]
    for e in (a, b):
        for run in runs:
            helpers.poll(lambda e=e, run=run: injected(world, on(run, e), v, "int-big"),
                         5 * PROPAGATE_S, f"replica :{e.proxy_port} to inject after it")


def test_the_file_backend_refuses_an_edited_run_record_too(factory, world):
    """state.backend: file shares the check: a run record edited in state.json (its token
    hash) is not served after a restart, and the log says why."""
    e = factory.make(mutate=cp_mutate(world))
    e.start()
    factory.started.append(e)
    v = sval("file")
    put_secret(e, "file_tok", v, org="acme")
    run = create_run(e, world, {"org": "acme"}, [bearer_pin(api_host(world), "file_tok")])
    assert injected(world, run, v, "int-file")
    e.stop()
    path = os.path.join(state_dir(e), "state.json")
    with open(path) as f:
        state = json.load(f)
    [rec] = [r for r in state["runs"] if r["id"] == run.id] if isinstance(state["runs"], list) \
        else [state["runs"][run.id]]
    mytoken = "attacker-token-" + pysecrets.token_hex(4)
    rec["token_sha256"] = hashlib.sha256(mytoken.encode()).hexdigest()
    with open(path, "w") as f:
        json.dump(state, f)
    e.start()
    mine = dataclasses.replace(run, token=mytoken)
    assert connect_status(mine, api_host(world))[0] == 407
    assert connect_status(run, api_host(world))[0] == 407
    assert f"run {run.id}: not served: its record does not verify" in e.stderr_text()
