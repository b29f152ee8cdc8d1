"""`keys rotate` of a state larger than one etcd request goes through in bounded
transactions. Two replicas on a real etcd (test_fleet.py's helpers)."""
from __future__ import annotations

import os
import secrets as pysecrets
import sys

import pytest

import helpers
from cp_helpers import api, bearer_pin, create_run, put_secret
from test_fleet import (KMS_STUB, PROPAGATE_S, api_host, injected, make_replica, on, sval,
                        start_replica)
from etcd_helpers import Etcd, require_etcd_bin


@pytest.fixture(scope="module")
def etcd(world):
    e = Etcd(require_etcd_bin(), world.new_dir("etcd-")).start()
    yield e
    e.stop()


def kms_fleet(factory, world, etcd, n: int = 2):
    """n replicas on a fresh prefix sharing one KMS (keys.kms_command: the fleet's way to
    rotate); returns (replicas, prefix, with_kms) to start more of the same."""
    kek = os.path.join(world.new_dir("kms-"), "kek")
    with open(kek, "wb") as f:
        f.write(os.urandom(32))
    kms = f"{sys.executable} {KMS_STUB} {kek}"

    def with_kms(cfg: dict):
        cfg["keys"]["kms_command"] = kms
    prefix = f"/egressd-int-{pysecrets.token_hex(3)}/"
    key = os.urandom(32)

    def replica():
        return start_replica(factory, make_replica(factory, world, prefix, [etcd.url], key,
                                                   then=with_kms))
    return [replica() for _ in range(n)], prefix, replica


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
