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
import ssl
import subprocess
import sys
import time

import pytest

import helpers
from helpers import poll
from clients import proxy_env, run_ca
from upstream import payload_sha256

MiB = 1 << 20
N_TRANSFERS = 50


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
        poll(lambda: len(world.upstream.find(marker)) >= N_TRANSFERS, 60, "50 transfers upstream")
        e.proc.send_signal(signal.SIGTERM)
        # The signal did land mid-body: most upstream writers are still part-way through.
        mid = sum(0 < world.upstream.progress(f"{marker}-{i}") < n for i in range(N_TRANSFERS))
        assert mid >= N_TRANSFERS // 2, f"only {mid} transfers were mid-body at SIGTERM"
        # Draining: /readyz fails and the proxy port stops accepting.
        poll(lambda: (e.admin_get("/readyz", timeout=0.5) or (0,))[0] == 503, 10,
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


def test_a_sighup_sent_as_soon_as_readyz_answers_is_not_lost(world, factory):
    """The SIGHUP handler was installed on the control thread's first turn, which the admin
    thread could beat: a reload sent right after /readyz first said 200 met the start's
    SIG_IGN and was lost (test_sighup_reload_valid_and_invalid failed about 1 run in 6 on a
    loaded machine). Now it exists before any thread starts. Five starts, each reloaded at
    once (a race: a build with the old order can pass some of them, not reliably all)."""
    for i in range(5):
        e = factory.start()  # returns as soon as /readyz answers 200
        e.proc.send_signal(signal.SIGHUP)
        poll(lambda: "reloaded" in e.stderr_text(), 10, f"start {i}: 'reloaded' after SIGHUP")
        assert e.stop() == 0


def test_sighup_reload_valid_and_invalid(world, factory, marker):
    e = factory.start()
    cfg_path = e.config_path
    with open(cfg_path) as f:
        original = f.read()
    # An invalid config is refused, named in the log, and the old one keeps serving.
    with open(cfg_path, "w") as f:
        f.write(original + "\npolicy_typo: 1\n")
    e.proc.send_signal(signal.SIGHUP)
    poll(lambda: "reload refused" in e.stderr_text(), 10, "reload refused log line")
    assert "policy_typo" in e.stderr_text()
    assert (e.admin_get("/readyz", timeout=1) or (0,))[0] == 200
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    r = helpers.request(c, "GET", f"/echo/{marker}-a", f"api.test:{world.U}")
    assert r.status == 200
    c.close()
    # A valid config is applied: here a host added to policy.allow_hosts (refused before,
    # tunnelled after), and the run CA is kept.
    c, r = helpers.proxy_connect(e.proxy_port, f"other.test:{world.U}", world.auth())
    assert (r.status, r.egress_reason) == (403, "host_not_allowed")
    c.close()
    with open(run_ca(e, "r1")) as f:
        ca_before = f.read()
    with open(cfg_path, "w") as f:
        f.write(original)
    e.rewrite_config(lambda cfg: cfg["policy"]["allow_hosts"].append("other.test"))
    e.reload()
    c, r = helpers.proxy_connect(e.proxy_port, f"other.test:{world.U}", world.auth())
    assert r.status == 200, (r.status, r.egress_reason)
    c.close()
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


def test_keep_alive_connection_outlives_the_runtime_it_began_with(world, factory, marker):
    """An intercepted HTTP/1.1 connection opened before a reload keeps serving after it: its
    requests move to the new runtime, and the connection reads each next head with the limits
    of the runtime it holds then, not with a reference into the config it began with (which
    nothing guarantees to outlive the move)."""
    e = factory.start()
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    try:
        host = f"api.test:{world.U}"
        assert helpers.request(c, "GET", f"/echo/{marker}-0", host).status == 200
        e.rewrite_config(lambda cfg: cfg["limits"].update({"idle_timeout": "45s"}))
        e.reload()
        for i in range(1, 4):  # the first moves the scope to the new runtime
            assert helpers.request(c, "GET", f"/echo/{marker}-{i}", host).status == 200
    finally:
        c.close()
    assert e.alive()


def test_refused_reload_leaves_ca_cert_out_naming_the_serving_ca(world, factory, marker):
    """A reload that would make r1 a new CA (ttl changed) but is refused (an empty secret file)
    writes no CA file: the file still holds the CA that serves, and clients trusting it work."""
    e = factory.start()
    ca = run_ca(e, "r1")
    with open(ca) as f:
        before = f.read()
    empty = os.path.join(e.workdir, "empty.secret")
    open(empty, "w").close()

    def mutate(c):
        c["runs"][0]["ttl"] = "1h"
        c["runs"][0]["pins"].append({"host": "new.test", "secret_file": empty,
                                     "inject": {"type": "bearer"}})
    e.rewrite_config(mutate)
    e.reload("reload refused")
    assert "secret_file" in e.stderr_text()
    with open(ca) as f:
        assert f.read() == before
    assert not [n for n in os.listdir(os.path.dirname(ca))
                if n.startswith(os.path.basename(ca) + ".tmp")]
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), ca)
    assert helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}").status == 200
    c.close()


def test_a_reload_of_an_emptied_config_file_is_refused(world, factory, marker):
    """An editor truncates the file and then writes it again: a SIGHUP in between read the
    empty file as all the defaults and dropped every static run (its clients got 407, and
    the reload after made it a new CA). Refused, named in the log; the run keeps serving with
    its CA, and the file written again reloads with that same CA."""
    e = factory.start()
    ca = run_ca(e, "r1")
    with open(ca) as f:
        ca_before = f.read()
    with open(e.config_path) as f:
        original = f.read()
    for i, text in enumerate(["", "# being edited\n\n"]):
        with open(e.config_path, "w") as f:
            f.write(text)
        e.reload("reload refused")
        line = e.last_line("reload refused")
        assert "config is empty" in line, line
        c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), ca)
        assert helpers.request(c, "GET", f"/echo/{marker}-{i}", f"api.test:{world.U}").status == 200
        c.close()
    with open(e.config_path, "w") as f:
        f.write(original)
    e.reload()
    with open(ca) as f:
        assert f.read() == ca_before, "the run has a new CA"
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), ca)
    assert helpers.request(c, "GET", f"/echo/{marker}-after", f"api.test:{world.U}").status == 200
    c.close()


def test_a_reload_refuses_a_broken_file_that_only_a_restart_would_read(world, factory, marker):
    """upstream.ca_file applies at the next start only; a reload naming a file that start
    would refuse is refused now, naming the key (it had said "reloaded", and the next
    restart, a pod rescheduled, failed). The running configuration keeps serving."""
    e = factory.start()
    e.rewrite_config(lambda c: c["upstream"].__setitem__("ca_file", "/nonexistent/ca.pem"))
    e.reload("reload refused")
    line = e.last_line("reload refused")
    assert "upstream.ca_file: " in line and "/nonexistent/ca.pem" in line, line
    assert "reloaded" not in line
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    assert helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}").status == 200
    c.close()


def test_ca_cert_out_never_follows_a_name_planted_beside_it(world, factory):
    """ca_cert_out is often in a folder the sandbox sees. A symlink planted at the name a
    temporary file of it would once have had (<path>.tmp) is neither followed nor truncated
    (egressd often runs as root): the CA is written under a new random name, renamed into
    place, a regular file."""
    d = world.new_dir("ca-out-")
    victim = os.path.join(d, "victim.txt")
    with open(victim, "w") as f:
        f.write("untouched\n")
    ca = os.path.join(d, "r1-ca.pem")
    os.symlink(victim, ca + ".tmp")
    e = factory.start(lambda c: c["runs"][0].__setitem__("ca_cert_out", ca))
    with open(victim) as f:
        assert f.read() == "untouched\n"
    assert not os.path.islink(ca)
    with open(ca) as f:
        assert f.read().startswith("-----BEGIN CERTIFICATE-----")
    assert e.config["runs"][0]["ca_cert_out"] == ca


def test_ca_bundle_out_holds_the_roots_and_the_run_ca_and_follows_a_new_ca(world, factory,
                                                                          marker):
    """A static run's ca_bundle_out is the roots egressd trusts upstream (upstream.ca_file: the
    test PKI's CA stands in for the system roots) followed by the run CA, so a client whose
    trust store it replaces (SSL_CERT_FILE …) verifies a pinned host (intercepted, the run CA)
    and a host tunnelled blind (its own certificate). A reload that makes a new CA rewrites it;
    one that changes nothing leaves the file alone. It had to be built by hand after each
    start (a static run gets a new CA at every start)."""
    d = world.new_dir("bundle-")
    bundle = os.path.join(d, "r1-bundle.pem")
    e = factory.start(lambda c: c["runs"][0].__setitem__("ca_bundle_out", bundle))
    with open(world.pki.ca) as f:
        roots = f.read()
    with open(run_ca(e, "r1")) as f:
        ca1 = f.read()
    with open(bundle) as f:
        assert f.read() == roots.rstrip("\n") + "\n" + ca1
    assert oct(os.stat(bundle).st_mode & 0o777) == "0o644"
    for host, injected in (("api.test", True), ("tunnel.test", False)):
        c = helpers.tunnel(e.proxy_port, host, world.U, world.auth(), bundle)
        r = helpers.request(c, "GET", f"/echo/{marker}-{host}", f"{host}:{world.U}")
        c.close()
        assert r.status == 200, (host, r.status, r.egress_reason)
        seen = world.upstream.find(f"{marker}-{host}")
        assert len(seen) == 1, host
        assert any(k.lower() == "authorization" for k, _ in seen[0].headers) == injected, host

    # A reload that keeps the CA: the bundle is not written again.
    inode = os.stat(bundle).st_ino
    e.reload()
    assert os.stat(bundle).st_ino == inode
    # A reload that makes r1 a new CA (its ttl changed): the bundle names the new one.
    e.rewrite_config(lambda c: c["runs"][0].__setitem__("ttl", "2h"))
    e.reload()
    with open(run_ca(e, "r1")) as f:
        ca2 = f.read()
    assert ca2 != ca1
    with open(bundle) as f:
        assert f.read() == roots.rstrip("\n") + "\n" + ca2
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), bundle)
    assert helpers.request(c, "GET", f"/echo/{marker}-2", f"api.test:{world.U}").status == 200
    c.close()


def test_ca_bundle_out_may_not_be_the_ca_file(world, factory):
    """The bundle and the CA file are two files: NODE_EXTRA_CA_CERTS names the CA file, and a
    bundle written over it would make every root the run's CA."""
    e = factory.make(lambda c: c["runs"][0].__setitem__(
        "ca_bundle_out", os.path.join(os.path.dirname(c["runs"][0]["ca_cert_out"]), ".",
                                      os.path.basename(c["runs"][0]["ca_cert_out"]))))
    r = e.check()
    assert r.returncode == 1
    assert "runs[0].ca_bundle_out: names the same file as ca_cert_out" in r.stdout + r.stderr


def test_a_static_token_changed_by_reload_closes_what_the_old_one_opened(world, factory, marker):
    """A leaked static proxy token rotated by a reload locks its holder out at once: the
    tunnel and the intercepted connection it opened are closed (an intercepted one had gone
    on injecting under the new terms), the old token gets 407, the new one is served."""
    tf = os.path.join(world.new_dir("tok-"), "r1.token")
    old, new = "old-" + os.urandom(8).hex(), "new-" + os.urandom(8).hex()

    def write_token(value: str):
        with open(tf, "w") as f:
            f.write(value + "\n")
        os.chmod(tf, 0o600)
    write_token(old)
    e = factory.start(lambda c: c["runs"][0].update(token_file=tf))
    old_auth, new_auth = helpers.basic_auth("r1", old), helpers.basic_auth("r1", new)
    blind, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", old_auth)
    assert r.status == 200
    icpt = helpers.tunnel(e.proxy_port, "api.test", world.U, old_auth, run_ca(e, "r1"))
    assert helpers.request(icpt, "GET", f"/echo/{marker}-1", f"api.test:{world.U}").status == 200
    write_token(new)
    e.reload()
    try:
        poll(lambda: helpers.closed_by_peer(blind), 5, "the tunnel opened with the old token "
             "to be closed")
        poll(lambda: helpers.closed_by_peer(icpt), 5, "the connection opened with the old token "
             "to be closed")
    finally:
        blind.close()
        icpt.close()
    _, r = helpers.proxy_connect(e.proxy_port, f"api.test:{world.U}", old_auth)
    assert (r.status, r.egress_reason) == (407, "bad_identity")
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, new_auth, run_ca(e, "r1"))
    assert helpers.request(c, "GET", f"/echo/{marker}-2", f"api.test:{world.U}").status == 200
    c.close()
    assert "run r1: its token or sources changed" in e.stderr_text()
    # A reload that changes nothing of it closes nothing.
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, new_auth, run_ca(e, "r1"))
    e.reload()
    assert helpers.request(c, "GET", f"/echo/{marker}-3", f"api.test:{world.U}").status == 200
    c.close()


def test_a_request_cut_with_its_runs_connections_is_audited_as_such(world, factory, marker):
    """A reload that changes a static run's token cuts the connections the old token opened,
    a download in flight with them; the request's audit record says why (run_changed), not
    client_aborted: egressd cut it, the client did not leave. So does a tunnel's."""
    tf = os.path.join(world.new_dir("tok-"), "r1.token")

    def write_token(value: str):
        with open(tf, "w") as f:
            f.write(value + "\n")
        os.chmod(tf, 0o600)
    old = "old-" + os.urandom(8).hex()
    write_token(old)
    e = factory.start(lambda c: c["runs"][0].update(token_file=tf))
    old_auth = helpers.basic_auth("r1", old)
    blind, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", old_auth)
    assert r.status == 200
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, old_auth, run_ca(e, "r1"))
    try:
        c.send(f"GET /bytes/4000000?pace=50&{marker} HTTP/1.1\r\nHost: api.test:{world.U}\r\n"
               "\r\n".encode())
        c.sock.settimeout(10)
        assert c.sock.recv(65536).startswith(b"HTTP/1.1 200")  # the download is under way
        write_token("new-" + os.urandom(8).hex())
        e.reload()
        deadline = time.monotonic() + 10  # the download's connection is cut: EOF or reset
        try:
            while c.sock.recv(65536) and time.monotonic() < deadline:
                pass
        except (ConnectionError, ssl.SSLError):
            pass
        assert time.monotonic() < deadline, "the download's connection was not cut"
        poll(lambda: helpers.closed_by_peer(blind), 10, "the tunnel to be cut")
    finally:
        c.close()
        blind.close()
    [rec] = e.wait_audit(lambda a: (a.get("path") or "").startswith("/bytes/4000000"))
    assert (rec["decision"], rec["status"], rec["reason"]) == ("allow", 200, "run_changed"), rec
    assert 0 < rec["bytes_out"] < 4000000
    [tun] = e.wait_audit(lambda a: a.get("host") == "tunnel.test" and a.get("status") == 200)
    assert tun["reason"] == "run_changed", tun


def sighup_ignored(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return int(line.split()[1], 16) & (1 << (signal.SIGHUP - 1)) != 0
    except OSError:
        pass
    return False


def test_sighup_during_startup_does_not_end_egressd(world, factory, marker, tmp_path):
    """A SIGHUP before the reload handler exists (a config tool reloading right after a
    restart) is ignored, not fatal: egressd ignores it first thing, then serves. The start is
    made a second longer (a KMS plugin slow to give its key id, as a remote KMS may be), so
    the window before the handler is one the test cannot miss."""
    kek = tmp_path / "kek"
    kek.write_bytes(os.urandom(32))
    slow = tmp_path / "slow-kms.sh"
    stub = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kms_stub.py")
    slow.write_text(f'#!/bin/sh\n[ "$1" = key-id ] && sleep 1\nexec {sys.executable} {stub} '
                    f'{kek} "$@"\n')
    slow.chmod(0o700)
    e = factory.make(lambda c: c["keys"].update(kms_command=str(slow)))
    factory.started.append(e)
    wait_ready = e.wait_ready

    def hup_then_wait(timeout: float = helpers.DEADLINE_READY_S):
        poll(lambda: sighup_ignored(e.proc.pid), 10, "SIGHUP ignored from the start",
             interval=0.001)
        e.proc.send_signal(signal.SIGHUP)
        wait_ready(timeout)
    e.wait_ready = hup_then_wait
    e.start()
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    assert helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}").status == 200
    c.close()
    assert e.stop() == 0


def test_sigterm_uses_the_drain_timeout_of_the_last_reload(world, factory):
    e = factory.start()  # drain_timeout 2s
    e.rewrite_config(lambda c: c["limits"].update({"drain_timeout": "20s"}))
    e.reload()
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth())
    assert r.status == 200
    e.proc.send_signal(signal.SIGTERM)
    poll(lambda: "draining (up to 20000 ms)" in e.stderr_text(), 10, "the reloaded drain_timeout")
    c.close()  # the tunnel ends within the drain: an ordinary record
    assert e.proc.wait(timeout=30) == 0
    recs = [r for r in e.audit_records() if r.get("host") == "tunnel.test"]
    assert [r["reason"] for r in recs] == ["tunnel"]


def test_work_cut_at_drain_timeout_is_audited(world, factory, marker):
    """At drain_timeout the open connections are shut down first, so a download and a tunnel
    still running end through their error paths and each writes its record, reason
    drain_timeout (DESIGN.md: every request ends in exactly one audit record)."""
    e = factory.start()  # drain_timeout 2s
    n = 4 * MiB
    # 64 KiB every 200 ms: ~13 s, far beyond the drain.
    p = subprocess.Popen(
        ["curl", "-sS", "--http1.1", "--max-time", "60", "--cacert", run_ca(e, "r1"),
         "-o", "/dev/null", f"https://api.test:{world.U}/bytes/{n}?pace=200&id={marker}"],
        env=proxy_env(e, "r1", world.tokens["r1"]), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.U}", world.auth())
    try:
        assert r.status == 200
        poll(lambda: world.upstream.progress(marker) > 0, 20, "the download under way")
        e.proc.send_signal(signal.SIGTERM)
        assert e.proc.wait(timeout=30) == 0
        p.wait(timeout=60)
    finally:
        c.close()
        if p.poll() is None:
            p.kill()
    assert "drain timeout: closing 2 in-flight requests and tunnels" in e.stderr_text()
    recs = e.audit_records()
    dl = [r for r in recs if r.get("path") == f"/bytes/{n}"]
    assert len(dl) == 1, dl
    assert dl[0]["decision"] == "allow" and dl[0]["reason"] == "drain_timeout"
    assert dl[0]["status"] == 200 and 0 < dl[0]["bytes_out"] < n
    tun = [r for r in recs if r.get("host") == "tunnel.test"]
    assert len(tun) == 1 and tun[0]["reason"] == "drain_timeout", tun


def test_request_waiting_on_a_silent_upstream_at_drain_timeout_is_audited(world, factory,
                                                                          marker):
    """A request still waiting for its upstream's answer at drain_timeout has its upstream part
    cut with its client connection, so it too ends with its record (it had none: shutting the
    client's socket is not noticed while egressd reads the upstream)."""
    e = factory.start()  # drain_timeout 2s
    p = subprocess.Popen(
        ["curl", "-sS", "--http1.1", "--max-time", "30", "--cacert", run_ca(e, "r1"),
         "-o", "/dev/null", f"https://api.test:{world.U}/delay/9000?{marker}"],
        env=proxy_env(e, "r1", world.tokens["r1"]), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        poll(lambda: len(world.upstream.find(marker)) == 1, 10, "the request at the upstream")
        t0 = time.monotonic()
        e.proc.send_signal(signal.SIGTERM)
        assert e.proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 6, "the drain waited for the upstream's answer"
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert "without an audit record" not in e.stderr_text()
    recs = [r for r in e.audit_records() if r.get("path") == "/delay/9000"]
    assert len(recs) == 1, recs
    assert recs[0]["decision"] == "allow" and recs[0]["reason"] == "drain_timeout", recs


@pytest.mark.parametrize("stage", ["tls_handshake", "dns"])
def test_a_dial_still_waiting_at_drain_timeout_is_cut_and_audited(world, factory, stage):
    """A request or tunnel whose upstream dial is still waiting at drain_timeout (a TLS
    handshake with an upstream that accepts and never answers; a DNS lookup a silent server
    never answers), with connect, TLS and DNS timeouts far beyond the drain: the drain's cut
    ends the wait, so egressd exits within the drain (plus its 1 s grace) and the request has
    its one audit record, reason drain_timeout."""
    silent_dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent_dns.bind(("127.0.0.1", 0))  # takes queries, answers none

    def slow(c):
        c["limits"].update(tls_timeout="60s", connect_timeout="60s", dns_timeout="60s")
        if stage == "dns":
            c["resolver"]["servers"] = [f"127.0.0.1:{silent_dns.getsockname()[1]}"]
    e = factory.start(mutate=slow)  # drain_timeout 2s
    done = []
    if stage == "tls_handshake":
        target = f"slow.test:{world.silent.port}"  # pinned: egressd's own TLS handshake waits

        def client():
            c, r = helpers.proxy_connect(e.proxy_port, target, world.auth(), timeout=30)
            if r.status == 200:
                t = helpers.tls_wrap(c, "slow.test", run_ca(e, "r1"), timeout=30)
                try:
                    helpers.request(t, "GET", "/cut-in-dial", target)
                except OSError:
                    pass
            done.append(r.status)
    else:
        target = f"nx-egressd-test.invalid:{world.U}"  # allowed, unpinned: a blind tunnel

        def client():
            try:
                c, r = helpers.proxy_connect(e.proxy_port, target, world.auth(), timeout=30)
                done.append(r.status)
            except OSError as ex:
                done.append(repr(ex))
    import threading
    accepted = len(world.silent.conns)
    th = threading.Thread(target=client, daemon=True)
    th.start()
    try:
        if stage == "tls_handshake":
            poll(lambda: len(world.silent.conns) > accepted, 10,
                 "egressd's dial to the silent upstream")
        else:
            silent_dns.settimeout(10)
            assert silent_dns.recv(512, socket.MSG_PEEK), "no DNS query came"
        t0 = time.monotonic()
        e.proc.send_signal(signal.SIGTERM)
        assert e.proc.wait(timeout=30) == 0
        took = time.monotonic() - t0
        th.join(10)
    finally:
        silent_dns.close()
    assert took < 6, f"egressd took {took:.1f}s to stop: the dial was not cut"
    assert "without an audit record" not in e.stderr_text(), e.stderr_text()[-1500:]
    host = target.split(":")[0]
    recs = [r for r in e.audit_records() if r.get("host") == host]
    assert len(recs) == 1, recs
    assert recs[0]["reason"] == "drain_timeout", recs


def _sigterm_within_the_drain(e) -> None:
    """SIGTERM; egressd exits 0 within drain_timeout (2 s) and its cut's 1 s grace, and no
    request or tunnel was left without its record."""
    t0 = time.monotonic()
    e.proc.send_signal(signal.SIGTERM)
    assert e.proc.wait(timeout=30) == 0
    took = time.monotonic() - t0
    assert took < 6, f"egressd took {took:.1f}s to stop"
    assert "without an audit record" not in e.stderr_text(), e.stderr_text()[-1500:]


def _one_drain_timeout_record(e, pred) -> dict:
    recs = [r for r in e.audit_records() if pred(r)]
    assert len(recs) == 1, recs
    assert recs[0]["decision"] == "allow" and recs[0]["reason"] == "drain_timeout", recs
    return recs[0]


def test_an_upload_to_an_upstream_that_stopped_reading_is_cut_and_audited_at_drain(world,
                                                                                   factory):
    """An upload whose upstream takes the head and never reads the body is still being written
    at drain_timeout: shutting its client down is not noticed there. The drain's cut ends the
    write too, so the request ends with its record (reason drain_timeout), not with the loop."""
    import threading
    e = factory.start()  # drain_timeout 2s; slow.test is the silent listener (never reads)
    target = f"slow.test:{world.silent.port}"
    total = 64 * MiB
    s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
    s.sendall((f"POST http://{target}/up HTTP/1.1\r\nHost: {target}\r\n"
               f"Proxy-Authorization: {world.auth()}\r\nContent-Length: {total}\r\n\r\n")
              .encode())
    sent = [0]

    def pump():
        chunk = b"a" * 65536
        try:
            while sent[0] < total:
                sent[0] += s.send(chunk)
        except OSError:
            pass  # egressd shut the connection down (or the send timed out)
    th = threading.Thread(target=pump, daemon=True)
    th.start()
    try:
        last = -1
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # until the upload stalls: every buffer is full
            time.sleep(0.2)
            if sent[0] == last and sent[0] > 0:
                break
            last = sent[0]
        assert 0 < sent[0] < total, sent
        _sigterm_within_the_drain(e)
        th.join(15)
    finally:
        s.close()
    rec = _one_drain_timeout_record(e, lambda r: r.get("path") == "/up")
    assert 0 < rec["bytes_in"] < total, rec


def test_a_download_whose_upstream_stalled_mid_body_is_cut_and_audited_at_drain(world,
                                                                                factory):
    """A download whose upstream sent part of its body and then went quiet: at drain_timeout
    egressd waits on the upstream, not on its (shut down) client. The cut ends that read."""
    import threading
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(10)
    port = srv.getsockname()[1]
    release = threading.Event()

    def serve():
        try:
            c, _ = srv.accept()
        except OSError:
            return
        with c:
            c.settimeout(10)
            buf = b""
            while b"\r\n\r\n" not in buf:
                got = c.recv(4096)
                if not got:
                    return
                buf += got
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 1000)
            release.wait(30)  # then silent, the connection open
    th = threading.Thread(target=serve, daemon=True)
    th.start()

    def m(c):
        c["runs"][0]["pins"].append({"host": f"slow.test:{port}",
                                     "secret_file": world.secret_files["api_token"],
                                     "inject": {"type": "bearer"}})
        c["policy"]["allowed_ports"].append(port)
    e = factory.start(mutate=m)  # drain_timeout 2s
    s = socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10)
    try:
        s.sendall((f"GET http://slow.test:{port}/stall HTTP/1.1\r\nHost: slow.test:{port}\r\n"
                   f"Proxy-Authorization: {world.auth()}\r\n\r\n").encode())
        got = b""
        while got.count(b"x") < 1000:
            piece = s.recv(65536)
            assert piece, got[:200]
            got += piece
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        _sigterm_within_the_drain(e)
    finally:
        release.set()
        s.close()
        srv.close()
        th.join(10)
    rec = _one_drain_timeout_record(e, lambda r: r.get("path") == "/stall")
    assert rec["status"] == 200 and rec["bytes_out"] == 1000, rec


def test_a_tunnel_whose_upstream_never_closes_is_cut_and_audited_at_drain(world, factory):
    """A blind tunnel to an upstream that never answers nor closes: at drain_timeout egressd
    shuts the client down and sends the upstream its FIN, which the upstream ignores; the cut
    ends the wait for the upstream's end."""
    e = factory.start()  # drain_timeout 2s
    c, r = helpers.proxy_connect(e.proxy_port, f"tunnel.test:{world.silent.port}", world.auth())
    try:
        assert r.status == 200
        c.send(b"hello")
        _sigterm_within_the_drain(e)
    finally:
        c.close()
    rec = _one_drain_timeout_record(e, lambda r: r.get("host") == "tunnel.test")
    assert rec["status"] == 200 and rec["bytes_out"] == 0, rec


def test_an_idle_h2_connection_gets_its_goaway_at_sigterm(world, factory, marker):
    """An HTTP/2 client connection with nothing in flight gets a GOAWAY (NO_ERROR) at SIGTERM
    before egressd exits: with nothing to wait for, the loops had stopped before the GOAWAY
    was written, and the client saw the connection drop without one."""
    from h2_helpers import H2Client
    for i in range(3):  # the loss was a race (usually lost): each start must send it
        e = factory.start()
        h = H2Client(e, world, "api.test", world.U)
        try:
            assert h.request(f"/echo/{marker}-{i}")["status"] == 200
            e.proc.send_signal(signal.SIGTERM)
            h.pump(timeout=5)
            assert h.goaway == 0, (i, h.goaway, h.closed)
        finally:
            h.close()
        assert e.proc.wait(timeout=10) == 0


def test_h2_stream_sent_after_sigterm_is_served_or_left_unprocessed(world, factory, marker):
    """A stream that reaches egressd after SIGTERM gets no final 503: egressd sends its GOAWAY
    at once, and a stream it had already received is served (as HTTP/1.1 serves a request
    with Connection: close); one that came after the GOAWAY is above its last-stream-id,
    unprocessed, which a client may retry elsewhere."""
    import h2.events
    from h2_helpers import H2Client
    e = factory.start(mutate=lambda c: c["limits"].update({"drain_timeout": "20s"}))
    h = H2Client(e, world, "api.test", world.U)
    assert h.request(f"/echo/{marker}-warm")["status"] == 200
    events = []
    receive = h.conn.receive_data
    h.conn.receive_data = lambda data: _record(events, receive, data)  # to see GOAWAY's id
    long_sid = h.headers(f"/bytes/{MiB}?pace=100&id={marker}-long")
    h.flush()
    poll(lambda: world.upstream.progress(f"{marker}-long") > 0, 10, "the long download")
    e.proc.send_signal(signal.SIGTERM)
    poll(lambda: "draining" in e.stderr_text(), 10, "the drain")
    sid = h.headers(f"/echo/{marker}-after")
    h.flush()
    r = h.responses[sid]
    h.pump(until=lambda: r["ended"] or r["reset"] is not None, timeout=15)
    h.pump(until=lambda: any(isinstance(ev, h2.events.ConnectionTerminated) for ev in events),
           timeout=15)
    goaways = [ev for ev in events if isinstance(ev, h2.events.ConnectionTerminated)]
    assert goaways, "no GOAWAY after SIGTERM"
    assert r["status"] != 503, f"stream refused while draining: {r}"
    if r["status"] is None:
        assert goaways[0].last_stream_id < sid, (goaways[0].last_stream_id, sid)
    else:
        assert r["status"] == 200
    assert goaways[0].last_stream_id >= long_sid
    h.close()
    assert e.proc.wait(timeout=30) == 0


def _record(events, receive, data):
    got = receive(data)
    events.extend(got)
    return got


def _read_body(c: helpers.Conn, n: int) -> tuple[bytes, str | None]:
    """Up to `n` body bytes (those already buffered first), and the error that ended the
    reading early (its type only)."""
    got, err = bytearray(c.buf), None
    c.buf = b""
    try:
        while len(got) < n:
            d = c.sock.recv(1 << 16)
            if not d:
                err = "eof"
                break
            got += d
    except OSError as ex:  # ssl.SSLError too
        err = type(ex).__name__
    return bytes(got[:n]), err


@pytest.mark.parametrize("leg", ["intercepted", "absolute_form"])
def test_a_response_done_in_the_drain_survives_a_pipelined_request(world, factory, marker, leg):
    """A response egressd finished during the drain reaches a client that pipelined a next
    request behind it and reads it late: the connection the drain closes after it lingers
    (reads and drops what the client sent, until the client took everything). Closed with the
    next request unread, it was reset and the response bytes still in egressd's kernel were
    lost (the client got ~120 KB of 2 MiB, then ECONNRESET), while the audit said 200 whole."""
    e = factory.start(mutate=lambda c: c["limits"].update({"drain_timeout": "20s"}))
    n = 2 * MiB
    if leg == "intercepted":
        up, host = world.upstream, f"api.test:{world.U}"
        c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))

        def req(path):
            return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    else:
        up, host = world.plain, f"plain.test:{world.plain.port}"
        c = helpers.Conn(socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10))
        c.sock.settimeout(10)

        def req(path):
            return (f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n"
                    f"Proxy-Authorization: {world.auth()}\r\n\r\n").encode()
    try:
        c.send(req(f"/bytes/{n}?pace=100&id={marker}"))
        head = c.read_until(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), head.split(b"\r\n")[0]
        c.send(req(f"/echo/{marker}-next"))
        poll(lambda: up.progress(marker) > 0, 10, "the download under way")
        e.proc.send_signal(signal.SIGTERM)
        # The client reads nothing until egressd has written the response into the kernel's
        # buffers (no longer in flight) and linger_timeout (2 s) has passed.
        poll(lambda: up.progress(marker) >= n, 20, "the whole body sent")
        time.sleep(3)
        body, err = _read_body(c, n)
        assert len(body) == n, f"got {len(body)} of {n} body bytes ({err})"
        assert hashlib.sha256(body).hexdigest() == payload_sha256(n)
    finally:
        c.close()
    assert e.proc.wait(timeout=30) == 0
    assert not up.find(f"{marker}-next"), "the pipelined request was served in the drain"


@pytest.mark.parametrize("case", ["intercepted_head", "absolute_form_head", "connect_before_tls",
                                  "h2_header_block"])
def test_a_request_begun_before_sigterm_is_served(world, factory, marker, case):
    """Work a client had begun when SIGTERM came counts in flight, as nginx counts a
    connection from the first byte of a head: a request head half received, an intercepted
    CONNECT answered whose TLS handshake was still to come, an HTTP/2 header block still
    incomplete. Its rest, sent 1 s after SIGTERM, is served; egressd used to exit at once
    with nothing else in flight, and the request was lost (EOF; the upstream never saw it)."""
    from hyperframe.frame import ContinuationFrame, HeadersFrame
    from h2_helpers import H2Client, RawH2
    e = factory.start(mutate=lambda c: c["limits"].update({"drain_timeout": "20s"}))
    host, up = f"api.test:{world.U}", world.upstream

    def sigterm():
        time.sleep(0.2)  # what was sent has reached egressd
        e.proc.send_signal(signal.SIGTERM)
        poll(lambda: "draining" in e.stderr_text(), 10, "the drain")
        time.sleep(1)  # past the 500 ms the drain gives HTTP/2 connections for their GOAWAY

    status, h = None, None
    try:
        if case == "intercepted_head":
            c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
            c.send(f"GET /echo/{marker} HTTP/1.1\r\nHost: {host}\r\n".encode())
            sigterm()
            c.send(b"\r\n")
            status = helpers.read_response(c).status
        elif case == "absolute_form_head":
            host, up = f"plain.test:{world.plain.port}", world.plain
            c = helpers.Conn(socket.create_connection(("127.0.0.1", e.proxy_port), timeout=10))
            c.sock.settimeout(10)
            c.send((f"GET http://{host}/echo/{marker} HTTP/1.1\r\nHost: {host}\r\n"
                    f"Proxy-Authorization: {world.auth()}\r\n").encode())
            sigterm()
            c.send(b"\r\n")
            status = helpers.read_response(c).status
        elif case == "connect_before_tls":
            c, r = helpers.proxy_connect(e.proxy_port, host, world.auth())
            assert r.status == 200
            sigterm()
            t = helpers.tls_wrap(c, "api.test", run_ca(e, "r1"))
            status = helpers.request(t, "GET", f"/echo/{marker}", host).status
        else:
            h = H2Client(e, world, "api.test", world.U)
            raw = RawH2(h)
            block = raw.enc.encode([(":method", "GET"), (":scheme", "https"),
                                    (":authority", host), (":path", f"/echo/{marker}")])
            sid = raw.next_sid
            raw.next_sid += 2
            st = raw.streams[sid] = {"status": None, "reset": None, "ended": False,
                                     "headers": [], "body": b""}
            raw.send(HeadersFrame(sid, data=block[:5], flags=["END_STREAM"]).serialize())
            sigterm()
            raw.send(ContinuationFrame(sid, data=block[5:], flags=["END_HEADERS"]).serialize())
            raw.pump(until=lambda: st["ended"] or st["reset"] is not None, timeout=10)
            status = st["status"] if st["ended"] else (st["status"], st["reset"], raw.closed)
    except (OSError, ConnectionError) as ex:  # ssl.SSLError too
        status = type(ex).__name__
    finally:
        if h is not None:
            h.close()
    assert status == 200, status
    assert up.find(marker), "the upstream never saw the request"
    assert e.proc.wait(timeout=30) == 0


def test_an_h2_response_done_in_the_drain_reaches_a_slow_reader(world, factory, marker):
    """An HTTP/2 response egressd finished during the drain reaches a client still reading it
    slowly (~320 KB/s): after the GOAWAY the connection closes lingering. Closed with the
    client's WINDOW_UPDATEs unread, it was reset and the client got ~800 KB of 2 MiB, while
    the audit said 200 whole."""
    from hyperframe.frame import WindowUpdateFrame
    from h2_helpers import H2Client, RawH2
    e = factory.start(mutate=lambda c: c["limits"].update({"drain_timeout": "20s"}))
    h = H2Client(e, world, "api.test", world.U, timeout=30, settings={4: 16 * MiB})
    try:
        raw = RawH2(h)
        raw.send(WindowUpdateFrame(0, window_increment=8 * MiB).serialize())
        n = 2 * MiB
        sid = raw.send_headers([(":method", "GET"), (":scheme", "https"),
                                (":authority", f"api.test:{world.U}"),
                                (":path", f"/bytes/{n}?pace=100&id={marker}")])
        st = raw.streams[sid]
        recv = h.sock.recv
        h.sock.recv = lambda k: (time.sleep(0.05), recv(min(k, 16384)))[1]  # ~320 KB/s
        raw.pump(until=lambda: world.upstream.progress(marker) >= 256 * 1024, timeout=20)
        e.proc.send_signal(signal.SIGTERM)
        raw.pump(until=lambda: st["ended"] or st["reset"] is not None, timeout=40)
        assert st["status"] == 200 and st["reset"] is None, (st["status"], st["reset"], len(st["body"]), st["headers"][:3], raw.closed, raw.goaway)
        assert len(st["body"]) == n and st["ended"], (len(st["body"]), raw.closed)
        assert hashlib.sha256(st["body"]).hexdigest() == payload_sha256(n)
        raw.pump(until=lambda: raw.goaway is not None, timeout=10)
        assert raw.goaway == 0
    finally:
        h.close()
    assert e.proc.wait(timeout=30) == 0


def test_static_run_ca_validity_and_its_expiry(world, factory, marker):
    """A run with ttl: null lives as long as the process: its CA gets
    limits.static_ca_validity (default 8760h), not 24 h. When it runs out the log says so and
    intercepted hosts fail; a reload with a new validity makes a new CA and rewrites
    ca_cert_out."""
    import datetime
    e = factory.start()
    end = subprocess.run(["openssl", "x509", "-noout", "-enddate", "-in", run_ca(e, "r1")],
                         capture_output=True, text=True, check=True).stdout.strip()
    not_after = datetime.datetime.strptime(end.split("=", 1)[1], "%b %d %H:%M:%S %Y %Z")
    days = (not_after - datetime.datetime.utcnow()).days
    assert 364 <= days <= 365, end
    assert "run r1 (ttl: null): run CA valid until" in e.stderr_text()

    short = factory.start(mutate=lambda c: c["limits"].update({"static_ca_validity": "3s"}))
    ca = run_ca(short, "r1")
    with open(ca) as f:
        before = f.read()
    poll(lambda: "run r1: its CA expired at" in short.stderr_text(), 15, "the expiry error")
    c, r = helpers.proxy_connect(short.proxy_port, f"api.test:{world.U}", world.auth())
    assert (r.status, r.egress_reason) == (502, "leaf_mint_failed")
    c.close()
    short.rewrite_config(lambda c: c["limits"].update({"static_ca_validity": "1h"}))
    short.reload()
    with open(ca) as f:
        assert f.read() != before
    c = helpers.tunnel(short.proxy_port, "api.test", world.U, world.auth(), ca)
    assert helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}").status == 200
    c.close()


def test_sighup_reopens_the_audit_file_and_names_keys_that_need_a_restart(world, factory,
                                                                          marker):
    e = factory.start()

    def get(tag):
        c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
        assert helpers.request(c, "GET", f"/echo/{marker}-{tag}", f"api.test:{world.U}") \
            .status == 200
        c.close()

    def records_in(path, tag):
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [l for l in f if f"{marker}-{tag}" in l]

    get("before")
    e.wait_audit(lambda r: f"{marker}-before" in r.get("path", ""))
    # logrotate: move the file away, SIGHUP; the next record goes to a new file at audit.path.
    os.rename(e.audit_path, e.audit_path + ".1")
    e.reload()
    assert "needs a restart" not in e.stderr_text()  # nothing changed
    get("rotated")
    e.wait_audit(lambda r: f"{marker}-rotated" in r.get("path", ""))
    assert records_in(e.audit_path + ".1", "rotated") == []

    # A new audit.path is applied; keys fixed at start are named.
    new_audit = os.path.join(e.workdir, "audit2.jsonl")

    def mutate(c):
        c["audit"].update({"path": new_audit, "durable": True})
        c["log"] = {"format": "json"}
        c["resolver"]["servers"] = ["127.0.0.1:5353"]
        c["limits"].update({"dns_timeout": "3s", "leaf_cache_size": 10,
                            "leaf_mints_per_minute": 7})
        c["keys"]["kms_command"] = "/bin/false wrap"
    e.rewrite_config(mutate)
    e.reload()
    line = next(l for l in e.stderr_text().splitlines() if "needs a restart" in l)
    for key in ["audit.durable", "log.format", "resolver.servers",
                "limits.dns_timeout", "limits.leaf_cache_size", "limits.leaf_mints_per_minute",
                "keys.kms_command"]:
        assert key in line, (key, line)
    assert "audit.path" not in line
    get("moved")
    poll(lambda: records_in(new_audit, "moved"), 10, "the record in the new audit.path")
    assert records_in(e.audit_path, "moved") == []


def restart_warnings(e) -> list[set[str]]:
    """The keys each "needs a restart" line of the log names, in order."""
    return [set(l.rsplit(": ", 1)[1].strip().split(", "))
            for l in e.stderr_text().splitlines() if "needs a restart" in l]


def test_a_reload_may_not_write_over_the_master_key_in_effect(world, factory):
    """A reload whose file moves keys.master_key_file (restart-only: the old path stays in
    effect) and points ca_cert_out at the old path passes the file's own checks (the two paths
    differ in the file), but would write the CA over the key in effect. The reload is checked
    again with the values in effect: refused, naming the key, and the key is untouched."""
    e = factory.start()
    key = e.config["keys"]["master_key_file"]
    with open(key, "rb") as f:
        key_bytes = f.read()

    def change(c):
        c["keys"]["master_key_file"] = os.path.join(os.path.dirname(key), "moved.key")
        c["runs"][0]["ca_cert_out"] = key
    e.rewrite_config(change)
    e.reload("reload refused")
    line = [ln for ln in e.stderr_text().splitlines() if "reload refused" in ln][-1]
    assert "runs[0].ca_cert_out: names the file of keys.master_key_file" in line, line
    with open(key, "rb") as f:
        assert f.read() == key_bytes


def test_keys_that_need_a_restart_keep_their_running_values_and_are_named_at_each_reload(
        world, factory, marker):
    """A reload compares the file with what the process started with: the warning names the
    restart-only keys whose file value differs from the one in effect, at every reload until
    the file is back to those values, and the running values stay in effect (ca_bundle_out
    keeps the roots egressd verifies upstreams with). It compared with the last reload's
    config: a second SIGHUP said nothing of the change still pending, restoring the file
    warned about values already in effect, and what the reload built (the bundle's roots, the
    control plane's master key path) used the file's values."""
    d = world.new_dir("restart-keys-")
    bundle = os.path.join(d, "r1-bundle.pem")
    e = factory.start(lambda c: c["runs"][0].__setitem__("ca_bundle_out", bundle))
    with open(world.pki.ca) as f:
        roots = f.read()
    with open(run_ca(e, "r1")) as f:
        ca1 = f.read()
    in_bundle = roots.rstrip("\n") + "\n" + ca1
    other_roots = os.path.join(d, "other-roots.pem")
    with open(other_roots, "w") as f:  # a valid bundle, not the roots in effect
        f.write(roots.rstrip("\n") + "\n" + ca1)
    other_key = os.path.join(d, "other.key")

    def change(c):
        c["keys"]["master_key_file"] = other_key
        c["upstream"]["ca_file"] = other_roots
        c["limits"]["leaf_cache_size"] = 10
    e.rewrite_config(change)
    pending = {"keys.master_key_file", "upstream.ca_file", "limits.leaf_cache_size"}
    e.reload()
    assert restart_warnings(e) == [pending]
    e.reload()  # the change is still in the file, still not in effect: named again
    assert restart_warnings(e) == [pending, pending]
    with open(bundle) as f:
        assert f.read() == in_bundle, "ca_bundle_out took roots a restart would apply"
    assert not os.path.exists(other_key)
    c = helpers.tunnel(e.proxy_port, "api.test", world.U, world.auth(), run_ca(e, "r1"))
    assert helpers.request(c, "GET", f"/echo/{marker}", f"api.test:{world.U}").status == 200
    c.close()

    # Back to the running value: no longer named; the others still are.
    e.rewrite_config(lambda c: c["limits"].pop("leaf_cache_size"))
    e.reload()
    assert restart_warnings(e)[2:] == [pending - {"limits.leaf_cache_size"}]
    # The file as egressd started with it: nothing to name.
    e.write_config()
    e.reload()
    assert len(restart_warnings(e)) == 3


def test_a_refused_reload_still_reopens_the_audit_file(world, factory):
    """logrotate moves the audit file and sends SIGHUP while the config is being edited (or a
    mounted secret file is briefly missing): the reload is refused, but the audit file is
    reopened all the same. Records had gone on to the moved file, lost when logrotate then
    removed it."""
    e = factory.start()

    def deny():
        c, r = helpers.proxy_connect(e.proxy_port, f"unlisted.test:{world.U}", world.auth())
        c.close()
        assert r.status == 403

    def denials(path):
        if not os.path.exists(path):
            return 0
        with open(path, "rb") as f:
            recs = helpers.audit_lines(f.read())
        return sum(1 for r in recs if r.get("host") == "unlisted.test")

    deny()
    poll(lambda: denials(e.audit_path) == 1, 5, "the first record")
    os.rename(e.audit_path, e.audit_path + ".1")
    with open(e.config_path, "a") as f:
        f.write("\nlimits_typo: 1\n")
    e.reload(expect="reload refused")
    for _ in range(3):
        deny()
    poll(lambda: denials(e.audit_path) == 3, 5, "the records in the reopened file")
    assert denials(e.audit_path + ".1") == 1


def test_sighup_rereads_the_admin_token(factory):
    """An operator rotating a leaked admin token: write the new one, SIGHUP. The old token is
    refused from then on; a reload whose token file is unreadable is refused whole and the
    token in use keeps working."""
    from cp_helpers import api
    e = factory.start()
    token_file = e.config["admin"]["token_file"]
    with open(token_file) as f:
        old = f.read().strip()
    assert api(e, "GET", "/v1/secrets", token=old).status == 200
    new = "rotated-admin-token-" + os.urandom(16).hex()
    with open(token_file, "w") as f:
        f.write(new + "\n")
    e.reload()
    assert api(e, "GET", "/v1/secrets", token=old).status == 401
    assert api(e, "GET", "/v1/secrets", token=new).status == 200
    line = next(l for l in reversed(e.stderr_text().splitlines()) if "reload" in l)
    assert "admin.token_file" not in line, line  # applied, not "needs a restart"

    os.rename(token_file, token_file + ".gone")
    e.reload(expect="reload refused")
    assert "admin.token_file: " in e.last_line("reload refused")
    assert api(e, "GET", "/v1/secrets", token=new).status == 200
    os.rename(token_file + ".gone", token_file)
    # A token file others may read grants them the admin API: refused, as a master key file
    # is, at a reload (the token in use keeps working) and at start.
    os.chmod(token_file, 0o644)
    e.reload(expect="reload refused")
    assert ("admin.token_file: " + token_file + " is readable by group or others (mode 0644)"
            in e.last_line("reload refused"))
    assert api(e, "GET", "/v1/secrets", token=new).status == 200
    other = factory.make()
    other.config["admin"]["token_file"] = token_file
    with pytest.raises(AssertionError):
        other.start()
    assert "is readable by group or others (mode 0644); chmod 600 it" in other.stderr_text()
    os.chmod(token_file, 0o600)
    # Neither token in anything egressd wrote but the token file the test wrote (the
    # factory's grep covers the test's secret values, not these).
    for path in (e.stderr_path, e.stdout_path, e.audit_path):
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            assert old.encode() not in data and new.encode() not in data, path
