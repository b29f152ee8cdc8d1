"""audit.durable (issue #7): a decision record is on disk before the injected request leaves,
and a completion record follows. After kill -9 under load and a restart, every request the
upstream saw has a decision record."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import helpers


def run_ca(e) -> str:
    return os.path.join(e.workdir, "r1-ca.pem")


def durable(cfg):
    cfg["audit"]["durable"] = True


def read_audit_lines(path: str) -> list[dict]:
    """Every complete line; a kill -9 may leave at most one partial line at the very end."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            assert i == len(lines) - 1, f"a corrupt audit line that is not the last: {line!r}"
    return out


def test_decision_then_completion_share_a_request_id(factory, world):
    e = factory.start(durable)
    tag = uuid.uuid4().hex[:8]
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth("r1"), run_ca(e))
    r = helpers.request(c, "GET", f"/echo/one-{tag}", f"api.test:{world.U}")
    assert r.status == 200
    c.close()
    recs = e.wait_audit(lambda x: x.get("path") == f"/echo/one-{tag}", count=2)
    decision, completion = recs[0], recs[1]
    assert decision["event"] == "decision" and decision["status"] == 0
    assert decision["pin"] == completion["pin"] is not None
    assert decision["secret"] == "api_token"
    assert "event" not in completion and completion["status"] == 200
    assert decision["req_id"] == completion["req_id"]
    assert decision["upstream_addr"] == completion["upstream_addr"]


def test_kill_9_under_load_leaves_a_decision_record_for_every_forwarded_request(factory, world):
    e = factory.start(durable)
    tag = uuid.uuid4().hex[:8]
    stop = threading.Event()
    deadline = time.monotonic() + 30

    def client(n: int):
        try:
            c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth("r1"), run_ca(e))
            for i in range(2000):  # bounded; the kill ends it much sooner
                if stop.is_set() or time.monotonic() > deadline:
                    break
                r = helpers.request(c, "GET", f"/echo/kill-{tag}-{n}-{i}", f"api.test:{world.U}")
                if r.status != 200:
                    break
        except Exception:
            pass  # the connection dies with egressd

    threads = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(8)]
    for t in threads:
        t.start()
    helpers.poll(lambda: len([s for s in world.upstream.requests if f"kill-{tag}-" in s.path])
                 >= 150, 20, "150 requests under load")
    e.kill()  # SIGKILL, mid-load
    factory.started.remove(e)  # it cannot exit 0 any more: checked by hand below
    stop.set()
    for t in threads:
        t.join(timeout=15)
    time.sleep(0.5)  # requests already forwarded are still reaching the upstream

    seen = {s.path for s in world.upstream.requests if f"kill-{tag}-" in s.path}
    assert len(seen) >= 150
    recs = read_audit_lines(e.audit_path)
    decided = {r["path"] for r in recs if r.get("event") == "decision"}
    missing = sorted(seen - decided)
    assert not missing, f"{len(missing)} forwarded requests without a decision record: {missing[:5]}"
    # Completion records follow their decision (same req_id, later in the file).
    first_decision = {}
    for i, r in enumerate(recs):
        if r.get("event") == "decision":
            first_decision.setdefault(r["req_id"], i)
    completions = [(i, r) for i, r in enumerate(recs)
                   if r.get("req_id") and "event" not in r and f"kill-{tag}-" in r["path"]]
    assert completions
    for i, r in completions:
        assert first_decision.get(r["req_id"], 1 << 60) < i, r

    # A restart on the same files serves again and appends after what survived.
    before = len(recs)
    e2 = helpers.Egressd(e.binary, e.workdir, e.config, world.secrets)
    factory.started.append(e2)
    e2.start()
    c = helpers.tunnel(e2.proxy_port, "api.test", world.U, world.auth("r1"), run_ca(e2))
    assert helpers.request(c, "GET", f"/echo/after-{tag}", f"api.test:{world.U}").status == 200
    c.close()
    e2.wait_audit(lambda x: x.get("path") == f"/echo/after-{tag}", count=2)
    assert len(read_audit_lines(e.audit_path)) >= before + 2
    assert not e.leaks(), "secret bytes written by the killed egressd"


def test_a_blind_tunnel_has_its_decision_on_disk_before_a_byte_is_relayed(factory, world):
    """audit.durable covers tunnels too: the decision record is written before the CONNECT's
    200, so a kill -9 with the tunnel open leaves it on disk; the completion shares its id."""
    e = factory.start(durable)
    tag = uuid.uuid4().hex[:8]
    raw, resp = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth("r1"))
    assert resp.status == 200
    # Read right after the 200, before a byte of the tunnel's TLS went anywhere.
    recs = [x for x in read_audit_lines(e.audit_path) if x.get("host") == "tunnel.test"]
    assert [(x.get("event"), x["reason"], x["status"]) for x in recs] == [
        ("decision", "tunnel", 0)]
    assert recs[0]["req_id"] and recs[0]["upstream_addr"] and recs[0]["run"] == "r1"
    c = helpers.tls_wrap(raw, "tunnel.test", world.pki.ca)
    r = helpers.request(c, "GET", f"/echo/tunnel-{tag}", f"tunnel.test:{world.U}")
    assert r.status == 200
    c.close()
    done = e.wait_audit(lambda x: x.get("host") == "tunnel.test" and "event" not in x)
    assert done[0]["req_id"] == recs[0]["req_id"] and done[0]["status"] == 200


def test_an_audit_log_that_cannot_be_written_stops_requests_and_tunnels(factory, world, marker):
    """audit.durable on a device where every write fails (/dev/full: ENOSPC): nothing is
    forwarded, an intercepted request and a blind tunnel alike get 503 audit_unavailable."""
    e = factory.start(lambda c: (durable(c), c["audit"].update(path="/dev/full")))
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth("r1"), run_ca(e))
    r = helpers.request(c, "GET", f"/echo/{marker}-pinned", f"api.test:{world.U}")
    c.close()
    assert (r.status, r.egress_reason) == (503, "audit_unavailable")
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth("r1"))
    c.close()
    assert (r.status, r.egress_reason) == (503, "audit_unavailable")
    assert not world.upstream.find(marker)
    # And it keeps serving: the refusals did not end the process.
    assert e.proc.poll() is None
