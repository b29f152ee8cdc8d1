"""Lifecycle: SIGTERM drains in-flight transfers (all 50 finish intact, exit 0, /readyz turns
503, new connections are refused); SIGHUP reloads a valid config and refuses an invalid one
while the old keeps serving; at start egressd re-executes itself once with a larger malloc
cache."""
from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import time

import helpers
from clients import proxy_env, run_ca
from upstream import payload_sha256

MiB = 1 << 20
N_TRANSFERS = 50


def _poll(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigterm_drains_50_inflight_transfers(world, factory, marker, tmp_path):
    e = factory.start(mutate=lambda c: c.setdefault("limits", {}).update({"drain_timeout": "60s"}))
    ca = run_ca(e, "r1")
    env = proxy_env(e, "r1", world.tokens["r1"])
    n = 2 * MiB
    procs = []
    for i in range(N_TRANSFERS):
        out = tmp_path / f"dl{i}.bin"
        # The upstream pauses 100 ms after each 64 KiB piece (~3 s per transfer, longer than
        # 50 curls take to start on a loaded two-core runner), so SIGTERM lands mid-body for
        # egressd itself. (A client-side --limit-rate would not: the kernel's socket buffers
        # hold 2 MiB, egressd would be done and exit at once.)
        procs.append((out, subprocess.Popen(
            ["curl", "-sS", "-f", "--http1.1", "--max-time", "120", "--cacert", ca, "-o", str(out),
             f"https://api.test:{world.U}/bytes/{n}?pace=100&id={marker}-{i}"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    try:
        # Every transfer has reached the upstream (and so is in flight through egressd).
        _poll(lambda: len(world.upstream.find(marker)) >= N_TRANSFERS, 60, "50 transfers upstream")
        e.proc.send_signal(signal.SIGTERM)
        # The signal did land mid-body: most upstream writers are still part-way through.
        mid = sum(0 < world.upstream.progress(f"{marker}-{i}") < n for i in range(N_TRANSFERS))
        assert mid >= N_TRANSFERS // 2, f"only {mid} transfers were mid-body at SIGTERM"
        # Draining: /readyz fails and the proxy port stops accepting.
        _poll(lambda: (e.admin_get("/readyz", timeout=0.5) or (0,))[0] == 503, 10,
              "/readyz 503 while draining")
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.1", e.proxy_port)) != 0, "new connection accepted"
        for out, p in procs:
            assert p.wait(timeout=120) == 0, p.stderr.read().decode(errors="replace")
            with open(out, "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == payload_sha256(n)
        assert e.proc.wait(timeout=30) == 0
    finally:
        for _out, p in procs:
            if p.poll() is None:
                p.kill()
    # One allow record per transfer, each with the whole body.
    recs = [r for r in e.audit_records() if r.get("path") == f"/bytes/{n}"]  # query removed
    assert len(recs) == N_TRANSFERS
    assert all(r["status"] == 200 and r["bytes_out"] == n for r in recs)


def test_sighup_reload_valid_and_invalid(world, factory, marker):
    e = factory.start()
    cfg_path = e.config_path
    with open(cfg_path) as f:
        original = f.read()
    # An invalid config is refused, named in the log, and the old one keeps serving.
    with open(cfg_path, "w") as f:
        f.write(original + "\npolicy_typo: 1\n")
    e.proc.send_signal(signal.SIGHUP)
    _poll(lambda: "reload refused" in e.stderr_text(), 10, "reload refused log line")
    assert "policy_typo" in e.stderr_text()
    assert (e.admin_get("/readyz", timeout=1) or (0,))[0] == 200
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    r = helpers.request(c, "GET", f"/echo/{marker}-a", f"api.test:{world.U}")
    assert r.status == 200
    c.close()
    # A valid config is applied: here log level debug, and the run CA is kept.
    with open(run_ca(e, "r1")) as f:
        ca_before = f.read()
    with open(cfg_path, "w") as f:
        f.write(original)
    e.proc.send_signal(signal.SIGHUP)
    _poll(lambda: "reloaded" in e.stderr_text(), 10, "reloaded log line")
    with open(run_ca(e, "r1")) as f:
        assert f.read() == ca_before
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    r = helpers.request(c, "GET", f"/echo/{marker}-b", f"api.test:{world.U}")
    assert r.status == 200
    c.close()


def test_restarts_itself_once_with_a_larger_malloc_cache(factory):
    """egressd re-executes itself at start with glibc.malloc.tcache_count added to
    GLIBC_TUNABLES (proxy/malloc_tuning.h): same pid, same process name, it serves, and says
    what it runs with; an operator's own tcache_count is left as it is. (The start-up log is
    the witness: /proc/PID/environ shows only the first tunable, glibc cuts the original
    string while it parses a copy.)"""
    def tunables_logged(e) -> list[str]:
        return re.findall(r"malloc: GLIBC_TUNABLES=(\S+)", e.stderr_text())

    e = factory.start()
    assert tunables_logged(e) == ["glibc.malloc.tcache_count=256"]
    with open(f"/proc/{e.proc.pid}/environ", "rb") as f:
        assert b"GLIBC_TUNABLES=glibc.malloc.tcache_count=256\0" in f.read()
    with open(f"/proc/{e.proc.pid}/comm") as f:
        assert f.read().strip() == "egressd"  # not "exe": it ran its own path
    assert e.admin_get("/readyz")[0] == 200

    for inherited, expected in [
            ("glibc.malloc.tcache_count=7", "glibc.malloc.tcache_count=7"),
            ("glibc.malloc.arena_max=2",
             "glibc.malloc.arena_max=2:glibc.malloc.tcache_count=256")]:
        o = factory.make()
        o.extra_env = {"GLIBC_TUNABLES": inherited}
        factory.started.append(o)
        o.start()
        assert tunables_logged(o) == [expected]
        assert o.admin_get("/readyz")[0] == 200


def _taskset_cpus(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(l for l in f if l.startswith("Cpus_allowed_list:"))
    n = 0
    for part in line.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(l for l in f if l.startswith("Threads:")).split()[1])


def test_worker_threads_key_and_its_cpu_aware_default(factory):
    """limits.worker_threads sets the number of event loops; 0 (the default) is one per CPU
    this process may use: pinned to one CPU with taskset, that is one, whatever the machine has."""
    three = factory.make(mutate=lambda c: c.setdefault("limits", {}).update({"worker_threads": 3}))
    factory.started.append(three)
    three.start()
    assert "(3 workers)" in three.stderr_text()
    assert _threads(three.proc.pid) >= 3

    pinned = factory.make()
    # One CPU this test may use (CPU 0 need not be in a container's cpuset).
    pinned.binary_prefix = ["taskset", "-c", str(min(os.sched_getaffinity(0)))]
    factory.started.append(pinned)
    pinned.start()
    assert _taskset_cpus(pinned.proc.pid) == 1
    assert "(1 workers)" in pinned.stderr_text()
    assert pinned.admin_get("/readyz")[0] == 200
