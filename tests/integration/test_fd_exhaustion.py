"""Waiting costs no CPU: egressd out of file descriptors, and ClientHellos stalled partway on
the transparent listener.

* Out of descriptors (EMFILE), a failed accept leaves the connection in the listen queue, so
  the next accept fails at once: the build before spun a core on it and wrote 1.6 M warning
  lines in 4 s. Now each acceptor pauses 100 ms after such a failure and warns at most once a
  second (with the count of failures it did not log).
* At start egressd raises its soft RLIMIT_NOFILE to the hard limit (a tunnel holds two
  descriptors: the default soft limit of 1024 ran out before connections_per_run's 512).
* A ClientHello stalled partway: its peeked bytes stay unread, so the socket stayed readable
  and the build before peeked it again every 5 ms until header_timeout. Now the wait asks the
  kernel (SO_RCVLOWAT) to wake it only when the rest of the current TLS record is there.

The transparent tests need root (network namespace, veth, iptables: test_transparent.py's
Sandbox); without it they are skipped with the reason.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
import uuid

import pytest

import helpers
from upstream import free_port

WINDOW_S = 3.0
# Under a sanitizer (helpers.SANITIZER) each wake-up costs more: the CPU bounds are wider.
SLOW = 4 if helpers.SANITIZER else 1
needs_prlimit = pytest.mark.skipif(shutil.which("prlimit") is None,
                                   reason="prlimit (util-linux) is not installed")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def count_in_file(path: str, needle: bytes) -> int:
    n = 0
    with open(path, "rb") as f:
        tail = b""
        while chunk := f.read(1 << 20):
            data = tail + chunk
            n += data.count(needle)
            tail = data[-(len(needle) - 1):]  # too short to hold a whole one: none twice
    return n


def log_head_has(e: helpers.Egressd, needle: bytes) -> bool:
    """Whether the first 4 MiB of egressd's log hold `needle` (the build before wrote ~30 MiB
    of warnings a second)."""
    with open(e.stderr_path, "rb") as f:
        return needle in f.read(4 << 20)


def nofile_limits(pid: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                soft, hard = line.split()[3:5]
                return int(soft), int(hard)
    raise AssertionError("no 'Max open files' in /proc/PID/limits")


def get_via_proxy(e: helpers.Egressd, world, path: str) -> helpers.Response:
    P = world.plain.port
    with socket.create_connection(("127.0.0.1", e.proxy_port), timeout=5) as s:
        s.settimeout(5)
        c = helpers.Conn(s)
        c.send((f"GET http://plain.test:{P}{path} HTTP/1.1\r\nHost: plain.test:{P}\r\n"
                f"Proxy-Authorization: {world.auth()}\r\nConnection: close\r\n\r\n").encode())
        return helpers.read_response(c)


@needs_prlimit

def cpu_over_window(pid: int) -> tuple[float, float]:
    """egressd's CPU seconds over WINDOW_S (after 0.2 s to settle), and the seconds it took."""
    time.sleep(0.2)
    cpu0 = cpu_seconds(pid)
    t0 = time.monotonic()
    time.sleep(WINDOW_S)
    return cpu_seconds(pid) - cpu0, time.monotonic() - t0

def test_out_of_descriptors_the_acceptor_waits_instead_of_spinning(factory, world, marker):
    """Under `prlimit --nofile=64:64` with 160 idle connections (egressd holds what it can,
    the rest wait in the listen queue): over 3 s egressd uses < 0.5 s of CPU and writes a
    handful of accept warnings (the build before: a full core, 1.6 M lines in 4 s); once the
    idle connections close, a request through the proxy is served."""
    limit = 64

    def mutate(cfg):
        # The idle connections are held by egressd until the test closes them.
        cfg["limits"]["header_timeout"] = "30s"
        cfg["limits"]["worker_threads"] = 1
    e = factory.make(mutate)
    e.binary_prefix = ["prlimit", f"--nofile={limit}:{limit}"]
    factory.started.append(e)
    e.start()
    pid = e.proc.pid
    assert nofile_limits(pid) == (limit, limit)
    idle = []
    try:
        for _ in range(limit * 5 // 2):
            idle.append(socket.create_connection(("127.0.0.1", e.proxy_port), timeout=2))
        helpers.poll(lambda: log_head_has(e, b"Too many open files"), 10,
                     "an accept failing with EMFILE")
        cpu, elapsed = cpu_over_window(pid)
        assert e.alive()
    finally:
        for s in idle:
            s.close()
    warnings = count_in_file(e.stderr_path, b"Too many open files")
    assert cpu < 0.5 * SLOW, \
        f"egressd used {cpu:.2f} s of CPU in {elapsed:.1f} s out of descriptors"
    assert warnings < 20, f"{warnings} accept warnings in the log"

    # The queued connections were closed by their clients: egressd takes them, reads their
    # end and lets them go; then a request is served as usual.
    def served():
        try:
            r = get_via_proxy(e, world, f"/echo?{marker}")
        except (OSError, ValueError):
            return None
        return r if r.status == 200 else None
    helpers.poll(served, 15, "a request served after the idle connections closed",
                 interval=0.2)
    assert len(world.plain.find(marker)) >= 1
    # Accepting again is said, with the failures no line said since the last warning.
    assert "accept on listen.proxy: accepting again" in e.stderr_text(), e.stderr_text()[-2000:]


@needs_prlimit
def test_the_soft_descriptor_limit_is_raised_to_the_hard_limit(factory):
    def mutate(cfg):
        cfg["limits"]["worker_threads"] = 1
    e = factory.make(mutate)
    e.binary_prefix = ["prlimit", "--nofile=256:2048"]
    factory.started.append(e)
    e.start()
    assert nofile_limits(e.proc.pid) == (2048, 2048)
    assert re.search(r"open files.*2048", e.stderr_text()), e.stderr_text()[-2000:]


# ---------------------------------------------------------------------------------------------
# The transparent listener: ClientHellos stalled partway, or trickled in pieces

# A ClientHello record header announcing 16000 bytes, a handshake header announcing 15996, then
# 15000 bytes of it: a plausible prefix that waits for the rest (what partial_ch.py sent).
_PARTIAL_HELLO = (bytes([0x16, 0x03, 0x01]) + (16000).to_bytes(2, "big") + bytes([0x01])
                  + (15996).to_bytes(3, "big") + b"\x03\x03" + b"\x00" * 14990)

_STALL_SCRIPT = """
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
payload = bytes.fromhex(sys.argv[4])
ss = []
for _ in range(n):
    s = socket.create_connection((host, port), timeout=5)
    s.sendall(payload)
    ss.append(s)
print("opened", len(ss), flush=True)
sys.stdin.read()  # held until the test closes our stdin
"""

# A real ClientHello (Python's ssl through memory BIOs) sent in four pieces 0.3 s apart: part
# of the record header, the header and a few bytes, all but the last byte, the last byte.
# Then the handshake and one request; prints the status line.
_TRICKLE_SCRIPT = """
import socket, ssl, sys, time
host, port, ca, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
ctx = ssl.create_default_context(cafile=ca)
ctx.set_alpn_protocols(["http/1.1"])
inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
tls = ctx.wrap_bio(inc, out, server_hostname=host)
s = socket.create_connection((host, port), timeout=10)
try:
    tls.do_handshake()
except ssl.SSLWantReadError:
    pass
hello = out.read()
prev = 0
for cut in (3, 45, len(hello) - 1, len(hello)):
    s.sendall(hello[prev:cut])
    prev = cut
    time.sleep(0.3)
def pump(op):
    while True:
        try:
            r = op()
        except ssl.SSLWantReadError:
            if out.pending:
                s.sendall(out.read())
            d = s.recv(65536)
            if not d:
                return None
            inc.write(d)
            continue
        if out.pending:
            s.sendall(out.read())
        return r
pump(tls.do_handshake)
tls.write(("GET " + path + " HTTP/1.1\\r\\nHost: " + host + ":" + str(port)
           + "\\r\\nConnection: close\\r\\n\\r\\n").encode())
s.sendall(out.read())
got = b""
while b"\\r\\n" not in got:
    try:
        d = pump(lambda: tls.read(65536))
    except ssl.SSLZeroReturnError:
        break
    if not d:
        break
    got += d
print(got.split(b"\\r\\n")[0].decode(), flush=True)
"""


@pytest.fixture(scope="module")
def stall_setup(world, factory):
    from test_transparent import SCRIPT, Sandbox, require_netns
    require_netns()
    tp = free_port()
    sb = Sandbox(f"egf{uuid.uuid4().hex[:4]}", "10.250.57.0", tp, [world.U], ["api.test"])
    try:
        def mutate(cfg):
            cfg["listen"]["transparent"] = f"0.0.0.0:{tp}"
            cfg["runs"][0]["sources"] = [f"{sb.address}/32"]
            cfg["limits"]["header_timeout"] = "15s"
            cfg["limits"]["worker_threads"] = 1
        e = factory.start(mutate)
        yield e, sb, SCRIPT
    finally:
        sb.down()


def test_stalled_client_hellos_cost_no_cpu(stall_setup, world):
    """100 connections that sent 15000 of a 16000-byte ClientHello record and stall: over 3 s
    egressd uses < 0.15 s of CPU (the build before peeked each one every 5 ms: ~0.8 s); when
    their client goes, egressd lets them go at once, not at header_timeout (15 s)."""
    e, sb, script = stall_setup
    n = 100
    pid = e.proc.pid
    proc = subprocess.Popen([script, "exec", sb.name, "--", "python3", "-c", _STALL_SCRIPT,
                             "api.test", str(world.U), str(n), _PARTIAL_HELLO.hex()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=helpers.clean_env())
    try:
        line = proc.stdout.readline()
        assert line.strip() == f"opened {n}", (line, proc.stderr.read() if proc.poll() else "")
        helpers.poll(lambda: helpers.active_connections(e) >= n, 5, f"{n} connections in egressd")
        cpu, elapsed = cpu_over_window(pid)
        assert helpers.active_connections(e) >= n  # still waiting (header_timeout is 15 s)
    finally:
        proc.stdin.close()  # the script exits: its sockets close (FIN)
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
    assert cpu < 0.15 * SLOW, \
        f"egressd used {cpu:.2f} s of CPU in {elapsed:.1f} s with {n} stalled ClientHellos"
    # Their rest can no longer come: egressd lets them go now, not at header_timeout (15 s).
    helpers.poll(lambda: helpers.active_connections(e) == 0, 5,
                 "the stalled connections let go once their client closed them")


def test_a_client_hello_trickled_in_pieces_is_served(stall_setup, world, marker):
    """Each wait is for the rest of the current record (its header, then its body): a
    ClientHello arriving in four pieces 0.3 s apart is read as one and served."""
    e, sb, script = stall_setup
    ca = os.path.join(e.workdir, "r1-ca.pem")
    r = subprocess.run([script, "exec", sb.name, "--", "python3", "-c", _TRICKLE_SCRIPT,
                        "api.test", str(world.U), ca, f"/echo?{marker}"],
                       capture_output=True, text=True, timeout=30, env=helpers.clean_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "HTTP/1.1 200 OK", (r.stdout, r.stderr)
    seen = world.upstream.find(marker)
    assert len(seen) == 1
    injected = seen[0].header("authorization") == [f"Bearer {world.secrets['api_token']}"]
    assert injected
