#!/usr/bin/env python3
"""Fleet (state.backend etcd): how long an admin write takes on replica A and how long until
replica B shows it. Usage: bench/fleet_latency.py ADMIN_TOKEN_FILE PORT_A PORT_B [N]
(two egressd replicas on one etcd prefix with the same master key; see bench/RESULTS.md)."""
import json, statistics, sys, time, urllib.error, urllib.request
T = open(sys.argv[1]).read().strip()
A, B = int(sys.argv[2]), int(sys.argv[3])
N = int(sys.argv[4]) if len(sys.argv) > 4 else 30
def call(port, method, path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {T}", "Host": f"127.0.0.1:{port}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
write, prop = [], []
for i in range(N):
    name = f"m{i}_{int(time.time()*1000)}"
    t0 = time.monotonic()
    st, _ = call(A, "POST", "/v1/secrets", {"name": name, "scope": {"org": "acme"}, "value": "x"*32})
    t1 = time.monotonic()
    assert st == 201, st
    deadline = t1 + 5
    while name.encode() not in call(B, "GET", "/v1/secrets")[1]:
        assert time.monotonic() < deadline, f"{name} not on B within 5 s"
    t2 = time.monotonic()
    write.append((t1-t0)*1000); prop.append((t2-t1)*1000)
q = lambda v: f"median {statistics.median(v):.1f} ms, p90 {sorted(v)[int(len(v)*0.9)]:.1f}, max {max(v):.1f}"
print("write on A (POST /v1/secrets, answered once A shows it):", q(write))
print("then visible on B (GET /v1/secrets polled):", q(prop))
